"""The answers a host writes to MMS's frontend: each Content-Type in its own field, no header map for it to cut."""

from __future__ import annotations

import struct

from mms.context import Context, RequestProcessor
from mms.protocol.otf_message_handler import create_predict_response

from mme_runtime.serving.connection import WireContext


def read_predictions(frame: bytes) -> list[dict[str, object]]:
    """MMS's ModelResponseDecoder, in full: code, message, then each prediction until -1."""
    at = 0

    def integer() -> int:
        nonlocal at
        (value,) = struct.unpack_from("!i", frame, at)
        at += 4
        return int(value)

    def text() -> str:
        nonlocal at
        length = integer()
        at += length
        return frame[at - length : at].decode()

    assert integer() == 200
    text()
    predictions = []
    while struct.unpack_from("!i", frame, at)[0] != -1:
        request_id, content_type, status, phrase = text(), text(), integer(), text()
        headers = {text(): text() for _ in range(integer())}
        predictions.append(
            {"id": request_id, "content_type": content_type, "status": status, "phrase": phrase, "headers": headers}
        )
        text()  # the body
    assert at + 4 == len(frame)
    return predictions


def test_each_content_type_travels_in_its_field_and_no_header_map_holds_it() -> None:
    context = WireContext.copy_of(Context("m", "/models/m", {}, 2, None, "1.1.11"))
    context.request_ids = {0: "a" * 36, 1: "b" * 36}
    context.request_processor = [RequestProcessor({}), RequestProcessor({})]
    context.set_response_content_type(0, "text/csv")
    context.set_response_content_type(1, "application/json")
    context.set_response_status(404, "Not Found", 1)

    frame = bytes(create_predict_response(["1,2", '{"a": 1}'], context.request_ids, "Prediction success", 200, context))

    assert read_predictions(frame) == [
        {"id": "a" * 36, "content_type": "text/csv", "status": 200, "phrase": "", "headers": {}},
        {"id": "b" * 36, "content_type": "application/json", "status": 404, "phrase": "Not Found", "headers": {}},
    ]
    assert context.get_response_content_type(1) == "application/json"


def test_the_copy_shares_the_models_properties_not_its_requests() -> None:
    model_context = Context("m", "/models/m", {}, 1, None, "1.1.11")
    copied = WireContext.copy_of(model_context)
    copied.request_ids = {0: "x"}
    assert copied.system_properties is model_context.system_properties
    assert model_context.request_ids is None

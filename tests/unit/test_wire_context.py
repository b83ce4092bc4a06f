"""The answers a host writes to MMS's frontend: each Content-Type in its own field, no header map for it to cut."""

from __future__ import annotations

import struct

from mms.context import Context, RequestProcessor
from mms.protocol.otf_message_handler import create_predict_response

from mme_runtime.serving.connection import WireContext, with_first_status_whole


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

    integer()  # the code
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


def status_offset(frame: bytes) -> int:
    message_end = 8 + int.from_bytes(frame[4:8], "big")
    content_type_at = message_end + 4 + int.from_bytes(frame[message_end : message_end + 4], "big")
    return content_type_at + 4 + int.from_bytes(frame[content_type_at : content_type_at + 4], "big")


def test_the_first_status_never_starts_at_or_runs_past_a_multiple_of_16() -> None:
    """The frontend's reads end at multiples of 16 bytes, and it reads a status without checking that it arrived."""
    for length in range(0, 80):
        context = WireContext.copy_of(Context("m", "/models/m", {}, 1, None, "1.1.11"))
        context.request_ids = {0: "a" * 36}
        context.request_processor = [RequestProcessor({})]
        context.set_response_content_type(0, "x" * length)
        frame = bytes(create_predict_response(["body"], context.request_ids, "Prediction success", 200, context))

        whole = with_first_status_whole(frame)

        assert 1 <= status_offset(whole) % 16 <= 12, length
        assert read_predictions(whole) == read_predictions(frame)
        assert len(whole) - len(frame) <= 4


def test_answers_other_than_200_are_left_as_they_are() -> None:
    frame = bytes(create_predict_response(None, {0: "a" * 36}, "Prediction failed", 503))
    assert with_first_status_whole(frame) == frame


def test_the_answers_own_content_type_wins_over_a_header_user_code_set_in_other_letters() -> None:
    context = WireContext.copy_of(Context("m", "/models/m", {}, 1, None, "1.1.11"))
    context.request_ids = {0: "a" * 36}
    context.request_processor = [RequestProcessor({})]
    context.set_response_header(0, "Content-Type", "text/\u00fc")
    context.set_response_content_type(0, "text/plain")
    assert context.get_response_content_type(0) == "text/plain"
    assert context.get_response_headers(0) == {}

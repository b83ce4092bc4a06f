"""The handler pieces with MMS's real Context and RequestProcessor objects, no server."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import model_factory
import numpy as np
import pytest
import torch
from mms.context import Context, RequestProcessor

from handler_service import HandlerService
from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError


def mms_context(model_dir: Path, requests: list[dict[str, str]], gpu: int | None = None) -> Context:
    context = Context("m", str(model_dir), None, len(requests) or 1, gpu, "1.1.11")
    context.request_processor = [RequestProcessor(headers) for headers in requests]
    context.request_ids = {index: f"req-{index}" for index in range(len(requests))}
    return context


def service_for(model_dir: Path) -> HandlerService:
    service = HandlerService(Config.from_env({}))
    service.initialize(mms_context(model_dir, []))
    return service


def test_each_batch_item_gets_its_own_content_type_and_status(tmp_path: Path) -> None:
    service = service_for(model_factory.torchscript_model(tmp_path / "m"))
    headers = [
        {"Content-Type": "application/json", "Accept": "text/csv"},
        {"Content-Type": "application/json"},
        {"Content-Type": "text/csv", "Accept": "application/x-npy"},
        {"Content-Type": "application/json", "Accept": "image/png"},
    ]
    context = mms_context(tmp_path / "m", headers)
    data = [{"body": b"[[1,2,3,4]]"}, {"body": b"[[1,2"}, {"body": b"1,2,3,4"}, {"body": b"[[1,2,3,4]]"}]
    results = service.handle(data, context)
    statuses = [context.get_response_status(i)[0] for i in range(4)]
    types = [context.get_response_content_type(i) for i in range(4)]
    assert statuses == [200, 400, 200, 406]
    assert types == ["text/csv", "application/json", "application/x-npy", "application/json"]
    error = json.loads(results[1])
    assert error["code"] == 400 and error["request_id"] == "req-1" and "malformed JSON" in error["message"]


def test_model_is_placed_once_in_eval_mode(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model_dir = model_factory.state_dict_model(tmp_path / "m")
    service = service_for(model_dir)
    model = service.served.model
    assert isinstance(model, torch.nn.Module) and not model.training


def test_state_dict_without_model_fn_explains_what_to_supply(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    torch.save(model_factory.tiny_net().state_dict(), model_dir / "model.pth")
    with pytest.raises(ModelLoadError, match="state dict.*supply model_fn"):
        service_for(model_dir)


def test_missing_model_file_names_what_was_looked_for(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelLoadError, match="no model.pt2 or model.pt or model.pth"):
        service_for(tmp_path / "m")


def test_memory_error_in_model_fn_is_507(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    model_factory.write_code(model_dir, "def model_fn(model_dir):\n    raise MemoryError()\n")
    with pytest.raises(Exception) as error:
        service_for(model_dir)
    assert getattr(error.value, "status_code", None) == 507


def test_sagemaker_default_accept_is_honoured(tmp_path: Path) -> None:
    model_dir = model_factory.torchscript_model(tmp_path / "m")
    service = HandlerService(Config.from_env({"SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT": "text/csv"}))
    service.initialize(mms_context(model_dir, []))
    context = mms_context(model_dir, [{"Content-Type": "application/json", "Accept": "*/*"}])
    service.handle([{"body": b"[[1,2,3,4]]"}], context)
    assert context.get_response_content_type(0) == "text/csv"


def test_batching_settings_reach_the_context_and_transform_fn_models_stay_unbatched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    batched = model_factory.torchscript_model(tmp_path / "batched")
    (batched / "serving.properties").write_text("batch_size=4\nmax_batch_delay=3\n")
    context = mms_context(batched, [])
    service = HandlerService(Config.from_env({}))
    service.initialize(context)
    settings = service.served.settings
    assert (settings.batch_size, settings.max_batch_delay_ms, settings.source) == (4, 3, "serving.properties")
    assert context.system_properties["batch_size"] == 4  # what context.batch_size reads

    whole = model_factory.transform_model(tmp_path / "whole")
    (whole / "serving.properties").write_text("batch_size=4\n")
    service = HandlerService(Config.from_env({}))
    service.initialize(mms_context(whole, []))
    assert service.served.settings.batch_size == 1
    assert "batch_size=4 ignored: transform_fn answers each request whole" in caplog.text


def test_an_mms_batch_runs_one_forward_pass_and_each_request_gets_its_rows(tmp_path: Path) -> None:
    """What plain MMS hands over when LOAD carried batch_size: several requests in one message."""
    model_dir = model_factory.torchscript_model(tmp_path / "m")
    (model_dir / "serving.properties").write_text("batch_size=8\n")
    service = service_for(model_dir)
    rows = [[[1.0, 2.0, 3.0, 4.0]], [[0.5, 0.5, 0.5, 0.5], [4.0, 3.0, 2.0, 1.0]]]
    context = mms_context(model_dir, [{"Content-Type": "application/json"}] * 2)
    calls = []
    model = service.served.model
    service.served._model = lambda data: calls.append(data.shape[0]) or model(data)  # counts forward passes

    results = service.handle([{"body": json.dumps(r).encode()} for r in rows], context)

    assert calls == [3]
    with torch.inference_mode():
        expected = [model_factory.tiny_net(0)(torch.tensor(r)).numpy() for r in rows]
    for result, want in zip(results, expected, strict=True):
        np.testing.assert_allclose(np.array(json.loads(result)), want, rtol=1e-5)


GRAD_OFF_SCRIPT = """
import json

import torch

torch.set_grad_enabled(False)  # as some scripts do at import, instead of no_grad in predict_fn


def predict_fn(data, model):
    return model(data)


def output_fn(prediction, accept):
    return json.dumps(prediction.numpy().tolist())  # fails on a tensor that requires grad
"""


def test_the_grad_mode_user_code_set_holds_in_the_executors_threads(tmp_path: Path) -> None:
    model_dir = model_factory.state_dict_model(tmp_path / "m")
    model_factory.write_code(model_dir, model_factory.STATE_DICT_SCRIPT + GRAD_OFF_SCRIPT)
    try:
        service = service_for(model_dir)
        service.start_batcher()  # as the executor does, on the thread that ran model_fn
        context = mms_context(model_dir, [{"Content-Type": "application/json"}])
        results: list[bytes] = []
        thread = threading.Thread(
            target=lambda: results.extend(service.handle([{"body": b'{"inputs": [[1, 2, 3, 4]]}'}], context))
        )
        thread.start()  # a connection's thread: torch starts it with grad enabled
        thread.join(10)
    finally:
        torch.set_grad_enabled(True)
    assert context.get_response_status(0)[0] in (None, 200), results
    assert len(json.loads(results[0])[0]) == model_factory.OUT_FEATURES


AWS_STYLE_INPUT_FN = """
import json

import torch


def input_fn(request_body, request_content_type):
    if request_content_type == "application/x-boom":
        raise RuntimeError("the decoder itself broke")
    data = json.loads(request_body)["inputs"]
    if request_content_type == "application/x-sixth":
        data = data[5]
    return torch.tensor(data, dtype=torch.float32)
"""


@pytest.mark.parametrize(
    ("body", "content_type", "status", "cause"),
    [
        (b"{not json", "application/json", 400, "JSONDecodeError: Expecting property name enclosed in double quotes"),
        (b'{"rows": [[1, 2, 3, 4]]}', "application/json", 400, "KeyError: 'inputs'"),
        (b'{"inputs": [[1, 2], [3]]}', "application/json", 400, "ValueError: expected sequence of length 2"),
        (b'{"inputs": "one two"}', "application/json", 400, "TypeError: new(): invalid data type 'str'"),
        (b'{"inputs": [[1, 2, 3, 4]]}', "application/x-sixth", 400, "IndexError: list index out of range"),
        (b"\xc3\x28", "application/x-bytes", 400, "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xc3"),
        (b'{"inputs": [[1, 2, 3, 4]]}', "application/x-boom", 500, "RuntimeError: the decoder itself broke"),
    ],
    ids=["json", "key", "value", "type", "index", "encoding", "other"],
)
def test_what_a_users_input_fn_cannot_decode_is_the_clients_error(
    tmp_path: Path, body: bytes, content_type: str, status: int, cause: str
) -> None:
    """An AWS-style input_fn, unchanged: its decoding errors answer 400 with their first line, the rest 500."""
    model_dir = model_factory.torchscript_model(tmp_path / "m")
    model_factory.write_code(model_dir, AWS_STYLE_INPUT_FN)
    service = service_for(model_dir)
    context = mms_context(model_dir, [{"Content-Type": content_type}])
    [answer] = service.handle([{"body": body}], context)
    assert context.get_response_status(0)[0] == status
    error = json.loads(answer)
    assert error["code"] == status and f"input_fn raised {cause}" in error["message"]
    assert "\n" not in error["message"] or status == 500


def test_the_batcher_an_adapter_shares_runs_no_thread_marked_as_that_adapter_s(tmp_path: Path) -> None:
    # A device host marks a model's threads with its slot (crash_board.py). The adapters of a base share one batcher
    # that outlives the adapter that made it: a thread of it marked with that adapter's slot could, once the slot
    # went to another model, blame that model for a crash in a pass over every adapter.
    import hf_models
    import lora_models

    adapter = lora_models.adapter(hf_models.bert(tmp_path / "base"), tmp_path / "adapter", seed=1)
    (adapter / "serving.properties").write_text("base_model=../base\nbatch_size=4\n")
    service = HandlerService(Config.from_env({"MME_MODEL_ROOT": str(tmp_path)}))
    service.initialize(mms_context(adapter, []))
    marked: list[int] = []
    service.served.thread_started = lambda: marked.append(threading.get_ident())
    service.start_batcher()
    results = service.handle([{"body": b'{"inputs": "a good movie"}'}], mms_context(adapter, [{}]))
    assert json.loads(results[0])[0]["label"], results
    assert marked == []


def test_an_unload_waits_on_the_model_only_where_no_other_model_holds_it(tmp_path: Path) -> None:
    """``MemoryRelease`` runs a full collection when a part an UNLOAD let go of stays alive: a model another one holds
    (the same package under two names) must not be a part, or every UNLOAD of it would stall the host."""
    served = service_for(model_factory.torchscript_model(tmp_path / "m")).served
    model = served.model
    assert any(part is model for part in served.parts())
    assert not any(part is model for part in served.parts(owns_model=False))
    assert served in served.parts(owns_model=False)


def answers_of_one_message(tmp_path: Path, transform_fn: str, bodies: list[bytes]) -> tuple[list[Any], Context]:
    """What a model whose script has ``transform_fn`` (source at column 0; ``json`` imported) answers to one MMS
    message of ``bodies``, and the message's context (each request's status and Content-Type)."""
    model_dir = tmp_path / "m"
    model_factory.write_code(model_dir, "import json\n\ndef model_fn(model_dir):\n    return None\n\n" + transform_fn)
    context = mms_context(model_dir, [{"Content-Type": "application/json"}] * len(bodies))
    return service_for(model_dir).handle([{"body": body} for body in bodies], context), context


def test_a_content_type_that_is_not_printable_ascii_answers_500_naming_it(tmp_path: Path) -> None:
    """MMS would misframe such an answer and drop the worker with every request on it: the request answers alone."""
    transform_fn = (
        "def transform_fn(model, body, content_type, accept):\n"
        '    return "hello", "text/plain; charset=\\u00fc" if "bad" in str(body) else "text/plain"\n'
    )
    results, context = answers_of_one_message(tmp_path, transform_fn, [b"bad", b"good"])
    assert [context.get_response_status(i)[0] for i in range(2)] == [500, 200]
    error = json.loads(results[0])
    assert "transform_fn" in error["message"] and "not printable ASCII" in error["message"]
    assert results[1] == b"hello" and context.get_response_content_type(1) == "text/plain"


def test_an_answer_over_the_frontends_limit_answers_500_naming_the_limit(tmp_path: Path) -> None:
    """MMS would take it for a corrupt answer and drop the worker with every request on it: it answers alone."""
    transform_fn = (
        "def transform_fn(model, body, content_type, accept):\n"
        '    return "x" * json.loads(body)["length"], "text/plain"\n'
    )
    limit = Config.from_env({}).max_response_bytes
    bodies = [json.dumps({"length": limit + 1}).encode(), json.dumps({"length": limit}).encode()]
    results, context = answers_of_one_message(tmp_path, transform_fn, bodies)
    assert [context.get_response_status(i)[0] for i in range(2)] == [500, 200]
    message = json.loads(results[0])["message"]
    assert f"returned {limit + 1} bytes, over the frontend's limit of {limit}" in message
    assert len(results[1]) == limit


def test_an_accept_that_is_not_printable_ascii_answers_406(tmp_path: Path) -> None:
    """It would become the answer's Content-Type where output_fn names none: the client's error, not the model's."""
    service = service_for(model_factory.torchscript_model(tmp_path / "m"))
    context = mms_context(tmp_path / "m", [{"Content-Type": "application/json", "Accept": "text/\u00fc"}])
    results = service.handle([{"body": b"[[1,2,3,4]]"}], context)
    assert context.get_response_status(0)[0] == 406
    assert "is not printable ASCII" in json.loads(results[0])["message"]

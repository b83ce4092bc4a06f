"""The handler pieces with MMS's real Context and RequestProcessor objects, no server."""

from __future__ import annotations

import json
from pathlib import Path

import model_factory
import pytest
import torch
from mms.context import Context, RequestProcessor

from handler_service import HandlerService
from mme_runtime.config import Config
from mme_runtime.errors import ModelLoadError


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
    model = service.transformer.model
    assert isinstance(model, torch.nn.Module) and not model.training


def test_state_dict_without_model_fn_explains_what_to_supply(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    torch.save(model_factory.tiny_net().state_dict(), model_dir / "model.pth")
    with pytest.raises(ModelLoadError, match="state dict.*supply model_fn"):
        service_for(model_dir)


def test_missing_model_file_names_what_was_looked_for(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelLoadError, match="no model.pt or model.pth"):
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

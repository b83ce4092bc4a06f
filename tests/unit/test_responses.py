"""What a failed load step or request answers with (mme_runtime/serving/content.py): status, the words of
base/failures.py, and a traceback for the log only."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from sagemaker_inference.errors import BaseInferenceToolkitError

from mme_runtime.base.errors import ContainerError, InsufficientMemory, ModelLoadError, RequestTimeout
from mme_runtime.serving.content import StepError, error_response, http_status, load_failure, release_memory_of

REQUEST = SimpleNamespace(model_name="m", request_id="r-1")


def test_an_exception_in_model_fn_is_named_with_its_type_and_keeps_its_traceback() -> None:
    cause = ValueError("bad config: layers=0")
    error = load_failure("model_fn", cause)
    assert type(error) is ModelLoadError and error.status == 500
    assert error.message == "model_fn raised ValueError: bad config: layers=0"
    assert error.trace is cause


@pytest.mark.parametrize(
    "cause", [MemoryError(), torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")]
)
def test_running_out_of_memory_in_model_fn_is_507_in_words(cause: Exception) -> None:
    error = load_failure("model_fn", cause)
    assert isinstance(error, InsufficientMemory) and error.status == 507
    assert error.message.startswith(
        "out of host memory in model_fn" if isinstance(cause, MemoryError) else "out of GPU"
    )
    assert error.trace is cause


def test_our_own_load_error_keeps_its_words_after_the_step() -> None:
    error = load_failure("model_fn", ModelLoadError("no model.pt2 or model.pt or model.pth in /m"))
    assert (type(error), error.message, error.trace) == (
        ModelLoadError,
        "model_fn failed: no model.pt2 or model.pt or model.pth in /m",
        None,
    )


def test_a_user_error_with_a_status_keeps_it() -> None:
    error = load_failure("model_fn", BaseInferenceToolkitError(429, "tenant over quota", "Too Many Requests"))
    assert (type(error), error.status, error.message) == (
        ContainerError,
        429,
        "model_fn raised BaseInferenceToolkitError: tenant over quota",
    )


def test_out_of_memory_in_predict_fn_answers_507_with_the_words_caught_at_the_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cause = MemoryError()
    error = StepError("predict_fn", cause, "out of host memory in predict_fn: MemoryError (host memory: 1 MiB ...)")
    with caplog.at_level(logging.ERROR):
        body, content_type = error_response(error, REQUEST)
    answer = json.loads(body)
    assert http_status(error) == 507 and content_type == "application/json"
    assert answer == {
        "code": 507,
        "type": "InsufficientMemory",
        "message": "out of host memory in predict_fn: MemoryError (host memory: 1 MiB ...)",
        "request_id": "r-1",
    }
    [record] = caplog.records
    assert record.getMessage() == f"model=m request=r-1 status=507: {answer['message']}"
    assert record.exc_info is not None and record.exc_info[1] is cause  # the user's traceback, not ours


def test_a_timeout_answers_504_and_logs_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    error = RequestTimeout("timed out after 60 s (SAGEMAKER_MODEL_SERVER_TIMEOUT): predict_fn still running")
    with caplog.at_level(logging.ERROR):
        body, _ = error_response(error, REQUEST)
    assert json.loads(body)["code"] == 504
    [record] = caplog.records
    assert record.getMessage().startswith("model=m request=r-1 status=504: timed out after 60 s")
    assert record.exc_info is None


def test_an_answered_out_of_memory_error_lets_go_of_its_frames() -> None:
    def predict() -> None:
        held = bytearray(1024)  # what the failed call held  # noqa: F841
        raise MemoryError

    try:
        predict()
    except MemoryError as exc:
        error = StepError("predict_fn", exc)
        error.__cause__ = cause = exc
    frame = cause.__traceback__.tb_next.tb_frame  # type: ignore[union-attr]
    assert "held" in frame.f_locals
    release_memory_of(error)
    assert "held" not in frame.f_locals

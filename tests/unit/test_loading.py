"""A failed LOAD's one log line (mme_runtime/models/loading.py): ``model=NAME gpu=G load failed status=S: CAUSE``,
then the traceback of what user code raised, and the status the frontend's connections are answered with."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.models.loading import LoadFailure, ModelSpec, check_memory, fail_load

SPEC = ModelSpec("m", "/models/m", "handler_service", "/tmp")


def test_a_failure_in_user_code_is_one_line_with_the_user_s_traceback(caplog: pytest.LogCaptureFixture) -> None:
    cause = ValueError("bad config: layers=0")
    with caplog.at_level(logging.ERROR):
        failure = fail_load(SPEC, 1, ModelLoadError("model_fn raised ValueError: bad config: layers=0", trace=cause))
    assert (failure.status, failure.message) == (500, "model m: model_fn raised ValueError: bad config: layers=0")
    [record] = caplog.records
    assert (
        record.getMessage() == "model=m gpu=1 load failed status=500: model_fn raised ValueError: bad config: layers=0"
    )
    assert record.exc_info is not None and record.exc_info[1] is cause


def test_memory_exhausted_outside_a_step_is_507(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        failure = fail_load(SPEC, None, MemoryError())
    assert failure.status == 507
    assert (
        caplog.records[0]
        .getMessage()
        .startswith(
            "model=m gpu=None load failed status=507: out of host memory in loading: MemoryError (host memory: "
        )
    )


def test_a_failure_decided_already_is_not_logged_twice(caplog: pytest.LogCaptureFixture) -> None:
    decided = LoadFailure(403, "model m: outside the model root")
    with caplog.at_level(logging.ERROR):
        assert fail_load(SPEC, None, decided) is decided
    assert caplog.records == []


def test_a_model_larger_than_host_memory_says_what_it_needs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    with open(model_dir / "model.pt", "wb") as weights:
        weights.truncate(1 << 40)  # 1 TiB on paper
    spec = ModelSpec("m", str(model_dir), "handler_service", str(tmp_path))
    with caplog.at_level(logging.ERROR), pytest.raises(LoadFailure) as refused:
        check_memory(spec, Config.from_env({"MME_MEMORY_HEADROOM_MB": "10"}), gpu=None)
    assert refused.value.status == 507
    assert refused.value.message.startswith(
        "model m: out of host memory: needs about 1048586 MiB (the model's 1048576 MiB + MME_MEMORY_HEADROOM_MB=10), "
    )
    assert caplog.records[0].getMessage().startswith("model=m gpu=None load failed status=507: out of host memory: ")
    assert caplog.records[0].exc_info is None  # nothing of user code to show

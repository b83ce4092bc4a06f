"""The words a failure opens with (mme_runtime/base/failures.py): one phrase per cause, numbers where they help, and
for a child killed by SIGKILL whether the kernel's out-of-memory killer sent it."""

from __future__ import annotations

import re
import signal
import socket
from pathlib import Path

import pytest
import torch

from mme_runtime.base import failures

CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 3.06 GiB is "
    "free. Including non-PyTorch memory, this process has 76.04 GiB memory in use. See documentation for Memory "
    "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
HOST_NUMBERS = r"host memory: \d+ MiB available of \d+ MiB"


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (MemoryError(), True),
        (torch.cuda.OutOfMemoryError(CUDA_OOM), True),
        (
            RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried"),
            True,
        ),
        (RuntimeError("CUDA error: device-side assert triggered"), False),  # never judged by the word "CUDA"
        (ValueError("out of memory"), False),
    ],
)
def test_out_of_memory_is_judged_by_type(exc: BaseException, expected: bool) -> None:
    assert failures.is_out_of_memory(exc) is expected


def test_host_out_of_memory_names_the_step_and_the_host_numbers() -> None:
    message = failures.out_of_memory(MemoryError(), "predict_fn")
    assert re.fullmatch(rf"out of host memory in predict_fn: MemoryError \({HOST_NUMBERS}.*\)", message), message


def test_gpu_out_of_memory_keeps_torch_s_first_words_only() -> None:
    message = failures.out_of_memory(torch.cuda.OutOfMemoryError(CUDA_OOM), "model_fn")
    head = "out of GPU memory in model_fn: CUDA out of memory. Tried to allocate 20.00 GiB"
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        assert message.startswith(f"{head} (GPU memory: ")
    else:  # no CUDA context here: no numbers, and none made up
        assert message == head


def test_a_missing_module_points_at_requirements_txt() -> None:
    message = failures.import_error(ModuleNotFoundError("No module named 'cv2'", name="cv2"), "code/inference.py")
    assert message == (
        "import error in code/inference.py: No module named 'cv2' (add the package that provides it to "
        "code/requirements.txt, or the module to code/)"
    )
    other = failures.import_error(ImportError("cannot import name 'x' from 'y'"), "model_fn")
    assert other == (
        "import error in model_fn: cannot import name 'x' from 'y' (check the versions code/requirements.txt asks for)"
    )


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ValueError("bad config: layers=0\nmore detail"), "model_fn raised ValueError: bad config: layers=0"),
        (KeyError("weights"), "model_fn raised KeyError: 'weights'"),
        (RuntimeError(), "model_fn raised RuntimeError"),
        (ModuleNotFoundError("No module named 'foo'"), "import error in model_fn: No module named 'foo' (add the"),
        (MemoryError(), "out of host memory in model_fn: MemoryError (host memory: "),
    ],
)
def test_what_a_step_raised_in_words(exc: BaseException, expected: str) -> None:
    assert failures.raised("model_fn", exc).startswith(expected)


def test_a_timeout_names_the_setting() -> None:
    assert failures.timed_out(300.4, "MME_PIP_TIMEOUT_SECONDS", "pip install -r r.txt") == (
        "timed out after 300 s (MME_PIP_TIMEOUT_SECONDS): pip install -r r.txt"
    )


@pytest.fixture
def counters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cgroup v2 ``memory.events`` of our own, with no kill counted yet."""
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 0\n")
    monkeypatch.setattr(failures, "OOM_KILL_COUNTERS", (events, tmp_path / "missing"))
    return events


def test_the_kernel_s_kill_counts_are_read_where_they_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    v1 = tmp_path / "memory.oom_control"
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("pgfault 100\noom_kill 2\n")
    monkeypatch.setattr(failures, "OOM_KILL_COUNTERS", (tmp_path / "memory.events", v1, vmstat))
    assert failures.oom_kills() == {str(v1): 7, str(vmstat): 2}


def test_sigkill_after_the_oom_killer_ran_says_out_of_memory(counters: Path) -> None:
    before = failures.oom_kills()
    counters.write_text("oom 2\noom_kill 1\n")
    cause = failures.exit_cause(-signal.SIGKILL, before)
    assert cause.startswith(
        f"killed by SIGKILL (out of memory: the kernel's out-of-memory killer ran (oom_kill 0 -> 1 in {counters}); "
        "host memory: "
    ), cause


def test_sigkill_with_the_oom_count_unchanged_says_it_was_not_the_oom_killer(counters: Path) -> None:
    before = failures.oom_kills()
    cause = failures.exit_cause(-signal.SIGKILL, before)
    assert cause == "killed by SIGKILL (not by the kernel's out-of-memory killer, whose count did not change)"


def test_sigkill_without_a_count_to_go_by_says_what_it_often_means(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failures, "OOM_KILL_COUNTERS", ())
    cause = failures.exit_cause(-signal.SIGKILL, failures.oom_kills())
    assert re.fullmatch(rf"killed by SIGKILL \(often the kernel's out-of-memory killer; {HOST_NUMBERS}.*\)", cause)


@pytest.mark.parametrize(
    ("code", "expected"),
    [(3, "exited with status 3"), (-signal.SIGSEGV, "killed by SIGSEGV"), (-signal.SIGABRT, "killed by SIGABRT")],
)
def test_other_ends_name_the_status_or_signal(code: int, expected: str) -> None:
    assert failures.exit_cause(code) == expected


def test_the_container_limit_is_read_from_its_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limit, used = tmp_path / "memory.max", tmp_path / "memory.current"
    used.write_text(f"{900 * 2**20}\n")
    monkeypatch.setattr(failures, "CGROUP_MEMORY", ((limit, used),))
    limit.write_text("max\n")
    assert failures.cgroup_memory() is None
    limit.write_text(f"{1024 * 2**20}\n")
    assert failures.cgroup_memory() == (900 * 2**20, 1024 * 2**20)
    assert failures.host_memory().endswith("; container: 900 MiB used of its 1024 MiB limit")


def test_a_watched_child_killed_by_a_signal_gets_its_line(counters: Path) -> None:
    deaths = failures.Deaths()
    deaths.watch(101, "model=m load failed: its loader pid=101")
    deaths.watch(102, "model=m backend server pid=102")
    deaths.watch(103, "model=n load failed: its loader pid=103")
    assert deaths.exited(101, -signal.SIGSEGV) == "model=m load failed: its loader pid=101 killed by SIGSEGV"
    assert deaths.exited(102, -signal.SIGTERM) is None  # ours: an UNLOAD or a stop
    assert deaths.exited(103, 0) is None
    assert deaths.exited(104, -signal.SIGKILL) is None  # not watched
    assert deaths.exited(101, -signal.SIGSEGV) is None  # once


def test_a_loader_the_oom_killer_ended_fails_its_load_with_507_and_any_other_death_with_500(counters: Path) -> None:
    from mme_runtime.models.loading import ModelSpec
    from mme_runtime.processes.shared_model import SharedModel

    spec = ModelSpec(name="m", model_dir="/opt/ml/models/m", handler="handler_service", tmp_dir="/tmp")
    stub, peer = socket.socketpair()
    model = SharedModel(spec, {}, stub, [], "", slot=0, started=0.0, oom_kills=failures.oom_kills())
    assert failures.oom_killed(-signal.SIGKILL, model.oom_kills) is False
    segfault = model.loader_failure(-signal.SIGSEGV)
    assert (segfault.status, segfault.message) == (500, "model m: its loader killed by SIGSEGV before it reported")
    counters.write_text("oom 2\noom_kill 1\n")
    assert failures.oom_killed(-signal.SIGKILL, model.oom_kills) is True
    assert failures.oom_killed(-signal.SIGSEGV, model.oom_kills) is False
    oom = model.loader_failure(-signal.SIGKILL)
    assert oom.status == 507 and oom.message.startswith("model m: its loader killed by SIGKILL (out of memory: "), oom
    assert model.loader_failure(None).status == 500  # its end unknown
    stub.close()
    peer.close()

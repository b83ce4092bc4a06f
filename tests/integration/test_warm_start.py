"""Warm start: isolated models' device hosts are forked from a warm, CUDA-free process, and such models stay isolated
from each other. What models that share a device host share, and what they do not, is in test_device_host.py."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import model_factory
import psutil
import pytest
from serving import HOST_TITLE, RunningServer, alive, start_server, wait_until

MARKING_SCRIPT = """
import builtins
import json
import sys


def model_fn(model_dir):
    return None


# Imported at LOAD, in this model's server only: a global side effect other models must never see.
builtins.MME_TEST_MARK = getattr(builtins, "MME_TEST_MARK", ()) + ("{name}",)


def transform_fn(model, body, content_type, accept):
    user_modules = sorted(m for m in sys.modules if m.startswith("mme_user_"))
    return json.dumps({{"marks": list(builtins.MME_TEST_MARK), "user_modules": user_modules}})
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(tmp_path_factory.mktemp("warm"), {"MME_SHARE_DEVICE": "false"}) as running:
        yield running


def warm_process(server: RunningServer) -> psutil.Process:
    [warm] = [
        p
        for p in psutil.Process(server.process.pid).children()
        if "mme_runtime.processes.warm_start" in " ".join(p.cmdline())
    ]
    return warm


def test_isolated_models_hosts_are_forked_from_the_warm_process(server: RunningServer) -> None:
    model_factory.torchscript_model(server.model_dir("warm"))
    started = time.perf_counter()
    assert server.load("warm").status_code == 200
    assert server.invoke("warm", json.dumps([[1, 2, 3, 4]])).status_code == 200
    elapsed = time.perf_counter() - started
    [host] = server.worker_pids("warm")
    assert psutil.Process(host).ppid() == warm_process(server).pid
    assert f"{HOST_TITLE} cpu --model-name warm" in " ".join(psutil.Process(host).cmdline())
    # On the CPU its host is forked while its loader loads, not after it (at its first connection).
    log = server.log_text()
    assert log.index("gpu=cpu model=warm started") < log.index("model=warm served by a device host of its own")
    print(f"LOAD to first response through the warm process: {elapsed:.3f} s")


def test_a_failed_load_leaves_no_host_of_its_own(server: RunningServer) -> None:
    model_factory.failing_model(server.model_dir("broken-own"))
    assert server.load("broken-own").status_code >= 400
    assert "gpu=cpu model=broken-own started" in server.log_text()  # forked while its loader loaded
    assert wait_until(lambda: not _own_hosts(server, "broken-own"), 10)


def _own_hosts(server: RunningServer, model: str) -> list[psutil.Process]:
    title, found = f"{HOST_TITLE} cpu --model-name {model}", []
    for process in alive(server.descendants()):
        try:
            if title in " ".join(process.cmdline()):
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


def test_a_served_model_leaves_no_descriptor_of_its_stub_s_stdio_in_the_warm_process(server: RunningServer) -> None:
    """At thousands of models every descriptor per model counts: once a model is served, the warm process keeps its
    socket, its stub's connection and its package, none of the stub's pipes."""
    assert wait_until(lambda: _launcher_entries(server), 60)  # the warm process is up: its one pipe open
    pipes_before = _pipes(warm_process(server))
    for name in ("quiet-a", "quiet-b", "quiet-c"):
        model_factory.torchscript_model(server.model_dir(name))
        assert server.load(name).status_code == 200
        assert server.invoke(name, json.dumps([[1, 2, 3, 4]])).status_code == 200
    assert wait_until(lambda: _pipes(warm_process(server)) <= pipes_before, 5)


def test_a_served_model_s_stub_holds_one_descriptor(server: RunningServer) -> None:
    """The process MMS started for a model waits on its connection to the warm process alone (its stdio closed):
    MMS's reading threads ended with its pipes, and nothing more is written there."""
    model_factory.torchscript_model(server.model_dir("one-fd"))
    assert server.load("one-fd").status_code == 200
    assert server.invoke("one-fd", json.dumps([[1, 2, 3, 4]])).status_code == 200
    [stub] = [p for p in psutil.Process(server.process.pid).children(recursive=True) if _is_stub(p, "one-fd")]
    descriptors = _descriptor_targets(stub)
    assert list(descriptors) == ["0"] and descriptors["0"].startswith("socket:"), descriptors
    assert server.unload("one-fd").status_code == 200
    assert wait_until(lambda: not alive([stub]), 10)


def test_stubs_go_to_one_process_at_the_lowest_priority_started_again_if_it_ends(server: RunningServer) -> None:
    """The JDK's launcher left kernel entries in each stub that its UNLOAD would free: the warm process sends each stub
    to one process of its own, at the lowest priority, that frees them meanwhile (launcher_entries.py)."""
    model_factory.torchscript_model(server.model_dir("idle-a"))
    assert server.load("idle-a").status_code == 200
    assert wait_until(lambda: _launcher_entries(server), 30)  # a new interpreter: titled once it runs
    [idle] = _launcher_entries(server)
    assert idle.ppid() == warm_process(server).pid
    assert os.sched_getscheduler(idle.pid) == os.SCHED_OTHER and idle.nice() == 19
    idle.kill()
    assert wait_until(lambda: not _launcher_entries(server), 30)
    model_factory.torchscript_model(server.model_dir("idle-b"))
    assert server.load("idle-b").status_code == 200
    assert wait_until(lambda: [process.pid for process in _launcher_entries(server)] not in ([], [idle.pid]), 30)
    assert server.invoke("idle-b", json.dumps([[1, 2, 3, 4]])).status_code == 200
    assert "ERROR" not in server.log_text().split("idle-a", 1)[1]  # its end is none of the models' concern


def _launcher_entries(server: RunningServer) -> list[psutil.Process]:
    found = []
    for process in alive(warm_process(server).children()):
        try:
            if process.cmdline()[:1] == ["mme-launcher-entries"]:
                found.append(process)
        except psutil.Error:
            continue
    return found


def test_the_frontend_connects_for_every_model_on_one_socket(server: RunningServer) -> None:
    """Each model's socket path links to one socket of the warm process, so a model holds no listening socket of its
    own: at thousands of models each descriptor counts."""
    for name in ("linked-a", "linked-b", "linked-c"):
        model_factory.torchscript_model(server.model_dir(name))
        assert server.load(name).status_code == 200
        assert server.invoke(name, json.dumps([[1, 2, 3, 4]])).status_code == 200
    listening = _listening_sockets(warm_process(server))
    assert sorted(Path(path).name for path in listening) == ["models.sock", "warm.sock"], listening
    assert server.unload("linked-b").status_code == 200
    assert server.invoke("linked-c", json.dumps([[1, 2, 3, 4]])).status_code == 200


def _listening_sockets(process: psutil.Process) -> list[str]:
    """The paths of the unix sockets ``process`` listens on (``/proc/net/unix``: flag 0x10000 is a listener)."""
    targets = _descriptor_targets(process).values()
    inodes = {target[len("socket:[") : -1] for target in targets if target.startswith("socket:[")}
    listening = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and int(fields[3], 16) & 0x10000:
            listening.append(fields[7])
    return listening


def _is_stub(process: psutil.Process, model: str) -> bool:
    try:
        return process.cmdline()[:1] == [f"mme-model-stub --model-name {model}"]
    except psutil.Error:
        return False


def _pipes(process: psutil.Process) -> int:
    return sum(target.startswith("pipe:") for target in _descriptor_targets(process).values())


def _descriptor_targets(process: psutil.Process) -> dict[str, str]:
    """What each open descriptor of ``process`` is (``socket:[inode]``, ``pipe:[inode]``, a path), by number."""
    targets = {}
    for fd in Path(f"/proc/{process.pid}/fd").iterdir():
        try:
            targets[fd.name] = fd.readlink().name
        except OSError:  # closed meanwhile
            continue
    return targets


def test_user_code_never_reaches_the_warm_process_or_another_model(server: RunningServer) -> None:
    for name in ("first", "second"):
        model_factory.write_code(server.model_dir(name), MARKING_SCRIPT.format(name=name))
        assert server.load(name).status_code == 200
    first = server.invoke("first", b"{}").json()
    second = server.invoke("second", b"{}").json()
    assert first["marks"] == ["first"] and second["marks"] == ["second"]
    assert len(first["user_modules"]) == len(second["user_modules"]) == 1
    assert first["user_modules"] != second["user_modules"]
    # A third model forked later still starts clean: the warm process imported nothing of theirs.
    model_factory.write_code(server.model_dir("third"), MARKING_SCRIPT.format(name="third"))
    assert server.load("third").status_code == 200
    assert server.invoke("third", b"{}").json()["marks"] == ["third"]


@pytest.mark.gpu  # without a driver libcuda is never loaded: only a GPU host can tell
def test_warm_process_holds_no_cuda(server: RunningServer) -> None:
    maps = Path(f"/proc/{warm_process(server).pid}/maps").read_text()
    assert "libcuda.so" not in maps  # the driver library is loaded only when CUDA is initialised


def test_unload_stops_the_model_s_own_host(server: RunningServer) -> None:
    model_factory.torchscript_model(server.model_dir("brief"))
    assert server.load("brief").status_code == 200
    processes = server.backend_processes("brief")
    assert len(processes) == 2  # its stub and its host
    assert server.unload("brief").status_code == 200
    assert wait_until(lambda: not alive(processes), 10)
    assert warm_process(server).is_running()


WARMUP_COUNTING_SCRIPT = """
import os

import torch


def model_fn(model_dir):
    return torch.jit.load(model_dir + "/model.pt", map_location="cpu")


def predict_fn(data, model):
    with open(os.path.join(os.path.dirname(__file__), "predictions.log"), "a") as log:
        log.write(f"{os.getpid()}\\n")
    with torch.inference_mode():
        return model(data)
"""


def test_a_sample_request_warms_every_worker_at_load(tmp_path: Path) -> None:
    with start_server(tmp_path, {"SAGEMAKER_MODEL_SERVER_WORKERS": "2"}) as server:
        model_dir = model_factory.torchscript_model(server.model_dir("warmed"))
        model_factory.write_code(model_dir, WARMUP_COUNTING_SCRIPT)
        model_factory.write_code(model_dir, "[[1, 2, 3, 4]]", name="warmup.json")
        assert server.load("warmed").status_code == 200
        log = model_dir / "code" / "predictions.log"
        workers = server.worker_pids("warmed")
        assert set(map(int, log.read_text().split())) == workers  # one dry run per worker, before any invoke
        assert "warm-up request seconds=" in server.log_text()

        broken = model_factory.torchscript_model(server.model_dir("badsample"))
        model_factory.write_code(broken, "[[1, 2]]", name="warmup.json")  # wrong shape for the model
        assert server.load("badsample").status_code == 400  # its own warmup.json is at fault
        assert wait_until(lambda: "warm-up request code/warmup.json failed" in server.log_text(), 5)

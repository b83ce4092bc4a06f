"""Many models, one process per device: the device host over the real MMS frontend.

Every shareable model is served by one device host per device (tests/fake_nvidia_smi.py lists fake GPUs to the
frontend); each model keeps its own answers, code, settings, errors and metrics; UNLOAD gives the memory back; a
model that kills the host costs the others a few seconds, and after a second time it leaves for processes of its own.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import fake_nvidia_smi
import model_factory
import numpy as np
import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from serving import HOST_TITLE, RunningServer, alive, device_hosts, is_stub, start_server, wait_until

ROWS = [[1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 2.0, 0.0]]

CRASHING_SCRIPT = """
import ctypes
import json
import os
import time


def model_fn(model_dir):
    return {"name": os.path.basename(model_dir)}


def transform_fn(model, body, content_type, accept):
    text = body.decode() if isinstance(body, (bytes, bytearray)) else str(body)
    if text == "abort":
        os.abort()
    if text == "segfault":
        ctypes.string_at(0)
    if text.startswith("sleep"):
        time.sleep(float(text.split()[1]))
    return json.dumps({"model": model["name"], "pid": os.getpid()}), "application/json"
"""

# model_fn returns what cannot be pickled (a lambda): the device host must run model_fn itself.
UNPICKLABLE_SCRIPT = """
import json
import os


def model_fn(model_dir):
    return {"scale": lambda x: x * 3, "pid": os.getpid()}


def transform_fn(model, body, content_type, accept):
    return json.dumps({"value": model["scale"](int(body)), "loaded_in": model["pid"]}), "application/json"
"""

CONCURRENCY_SCRIPT = """
import json
import os
import time


def model_fn(model_dir):
    return model_dir


def transform_fn(model_dir, body, content_type, accept):
    started = time.monotonic()
    time.sleep(0.2)
    with open(os.path.join(model_dir, "spans.log"), "a") as log:
        log.write(f"{started} {time.monotonic()}\\n")
    return json.dumps({"ok": True}), "application/json"
"""


def expected(seed: int) -> np.ndarray:
    import torch

    with torch.inference_mode():
        return model_factory.tiny_net(seed)(torch.tensor(ROWS)).numpy()


def hosts(server: RunningServer) -> list[psutil.Process]:
    return device_hosts(alive(server.descendants()))


def shared_hosts(server: RunningServer) -> list[psutil.Process]:
    """The hosts of every model that shares: a private host's title names its model."""
    return [host for host in hosts(server) if "--model-name" not in " ".join(host.cmdline())]


def model_processes(server: RunningServer, name: str) -> list[psutil.Process]:
    """The processes started for ``name`` alone: its stub, and its own device host if it has one."""
    found = []
    for process in alive(server.descendants()):
        try:
            words = " ".join(process.cmdline()).split()
        except psutil.Error:
            continue
        if "--model-name" in words and words[words.index("--model-name") + 1] == name:
            found.append(process)
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(tmp_path_factory.mktemp("device-host"), {"MME_TEST_PREDICT_SLEEP": "0"}) as running:
        yield running


def test_twenty_models_are_served_by_one_process_each_with_its_own_answers(server: RunningServer) -> None:
    names = []
    for index in range(20):
        name = f"many{index}"
        builder = model_factory.torchscript_model if index % 2 else model_factory.state_dict_model
        builder(server.model_dir(name), seed=index)
        names.append(name)
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda name: server.load(name).status_code, names)) == [200] * 20

    def answer(index: int) -> np.ndarray:
        body = json.dumps(ROWS if index % 2 else {"inputs": ROWS})
        response = server.invoke(names[index], body)
        assert response.status_code == 200, response.text
        result = response.json()
        return np.array(result if index % 2 else result["predictions"])

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(answer, [index for _ in range(3) for index in range(20)]))
    for position, result in enumerate(answers):
        np.testing.assert_allclose(result, expected(position % 20), rtol=1e-5)  # each client its own model's answer

    cpu_hosts = {host.pid for host in hosts(server)}
    assert len(cpu_hosts) == 2  # the CPU's two hosts (MME_CPU_HOSTS), each serving half of the models
    served_by = [server.hosts_of(name) for name in names]
    assert all(len(pids) == 1 and pids <= cpu_hosts for pids in served_by)
    assert sorted(Counter(pid for pids in served_by for pid in pids).values()) == [10, 10]
    for name in names:
        [stub] = model_processes(server, name)  # MMS's process for the model, and nothing else of its own
        assert is_stub(stub)
        assert stub.memory_info().rss < 8 * 2**20  # cat, not Python
    # Nor does the frontend keep a thread reading each stub's stdout and stderr (W-<port>-<model>-stdout, 15
    # characters of it in /proc): once a model is served, nothing more is logged through its stub.
    [frontend] = [process for process in server.descendants() if process.name() == "java"]

    def pipe_readers() -> list[str]:
        names = [Path(f"/proc/{frontend.pid}/task/{thread.id}/comm") for thread in frontend.threads()]
        return [comm for path in names if path.exists() and re.match(r"W-\d+-many\d+-s", comm := path.read_text())]

    assert wait_until(lambda: not pipe_readers(), 10), pipe_readers()
    for name in names:
        assert server.unload(name).status_code == 200


def test_requests_to_a_hosted_model_print_no_line_each(server: RunningServer) -> None:
    # docs/api.md#logs: per-request lines are off (on SageMaker each is a CloudWatch Logs line the customer pays for).
    model_factory.torchscript_model(server.model_dir("quiet"))
    assert server.load("quiet").status_code == 200
    for _ in range(5):
        assert server.invoke("quiet", json.dumps(ROWS)).status_code == 200
    assert server.shares_device_host("quiet")
    assert "[METRICS]" not in server.log_text() and "ModelName:quiet" not in server.log_text()
    assert server.unload("quiet").status_code == 200
    # Nor MMS's pipe readers' bookkeeping: 6 lines per LOAD and UNLOAD, 24,000 for 2,000 models loaded and unloaded.
    assert wait_until(lambda: "model=quiet unloaded" in server.log_text(), 10)
    quiet = [line for line in server.log_text().splitlines() if "quiet" in line]
    assert not [line for line in quiet if re.search(r"Stopped Scanner|IOStreams\(\)", line)], quiet


def test_unload_gives_the_host_memory_back(server: RunningServer) -> None:
    model_factory.wide_model(server.model_dir("wide"))  # 4 MB of weights, and a model_fn that runs them
    model_factory.torchscript_model(server.model_dir("resident"))
    assert server.load("resident").status_code == 200
    assert server.load("wide").status_code == 200  # every host it may land on exists from here on
    assert server.unload("wide").status_code == 200

    def settled_rss() -> int:
        time.sleep(0.5)
        return sum(int(host.memory_info().rss) for host in hosts(server))

    before = settled_rss()
    for _ in range(5):
        assert server.load("wide").status_code == 200
        assert server.invoke("wide", json.dumps([[0.0] * model_factory.WIDE_FEATURES])).status_code == 200
        assert server.unload("wide").status_code == 200
    after = settled_rss()
    assert after <= before * 1.10 + 16 * 2**20, (before, after)
    assert server.invoke("resident", json.dumps(ROWS)).status_code == 200


def test_a_cpu_host_left_with_no_model_ends_after_a_while_and_the_next_model_starts_one(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # An empty host held 40-50 MiB of its models' freed heap after a mass UNLOAD (issue #37); ending it at its last
    # UNLOAD cut LOAD-UNLOAD churn from 35 to 23 cycles/s, so it lives on a while (MME_EMPTY_HOST_SECONDS).
    env = {"MME_TEST_PREDICT_SLEEP": "0", "MME_EMPTY_HOST_SECONDS": "2"}
    with start_server(tmp_path_factory.mktemp("empty-hosts"), env) as server:
        for name in ("stays", "goes"):
            model_factory.torchscript_model(server.model_dir(name))
            assert server.load(name).status_code == 200
        [stays_host], [goes_host] = server.hosts_of("stays"), server.hosts_of("goes")
        assert stays_host != goes_host  # one each: the CPU's two hosts
        assert server.unload("goes").status_code == 200
        assert server.load("goes").status_code == 200  # within the while: the same host takes it
        assert server.hosts_of("goes") == {goes_host}
        assert server.unload("goes").status_code == 200
        unloaded = time.monotonic()
        assert wait_until(lambda: {host.pid for host in shared_hosts(server)} == {stays_host}, 10)
        assert time.monotonic() - unloaded > 1.5
        assert "retired: it serves no model" in server.log_text()
        assert server.load("goes").status_code == 200
        assert server.invoke("goes", json.dumps(ROWS)).status_code == 200
        [again] = server.hosts_of("goes")
        assert again not in (stays_host, goes_host)  # a new one, for the pool's emptier place
        assert server.invoke("stays", json.dumps(ROWS)).status_code == 200


def test_a_model_that_cannot_travel_is_loaded_in_the_host_and_the_log_says_why(server: RunningServer) -> None:
    model_factory.write_code(server.model_dir("unpicklable"), UNPICKLABLE_SCRIPT)
    assert server.load("unpicklable").status_code == 200
    response = server.invoke("unpicklable", "14", "text/plain")
    assert response.status_code == 200, response.text
    assert response.json() == {"value": 42, "loaded_in": server.hosts_of("unpicklable").pop()}
    assert "model=unpicklable model_fn runs in the device host" in server.log_text()
    assert server.unload("unpicklable").status_code == 200


def test_isolation_and_unmet_requirements_get_a_device_host_of_their_own(server: RunningServer) -> None:
    model_factory.torchscript_model(server.model_dir("own"))
    (server.model_dir("own") / "serving.properties").write_text("isolation=process\n")
    model_factory.state_dict_model(server.model_dir("pinned"))
    numpy = metadata.version("numpy")
    (server.model_dir("pinned") / "code" / "requirements.txt").write_text(f"numpy=={numpy}\n")
    for name in ("own", "pinned"):
        assert server.load(name).status_code == 200
    assert server.invoke("own", json.dumps(ROWS)).status_code == 200
    assert server.invoke("pinned", json.dumps({"inputs": ROWS})).status_code == 200

    [stub, own_host] = sorted(model_processes(server, "own"), key=lambda process: process.pid)
    assert own_host.cmdline()[0].startswith(f"{HOST_TITLE} cpu --model-name own")  # its stub and its host
    assert "mme_runtime.processes.warm_start" in " ".join(own_host.parent().cmdline())  # forked, as every host is
    assert len(model_processes(server, "pinned")) == 1  # what the image already has costs no process
    reason = "serving.properties sets isolation=process"
    assert f"model=own served by a device host of its own: {reason}" in server.log_text()
    assert server.unload("own").status_code == 200
    assert wait_until(lambda: not psutil.pid_exists(own_host.pid) or own_host.status() == psutil.STATUS_ZOMBIE, 10)
    assert server.unload("pinned").status_code == 200


HANDLER_OF_ITS_OWN = """
import json
import os

_state = {}


def handle(data, context):
    if data is None:  # MMS's initialise call
        _state["initialised_in"] = os.getpid()
        return None
    return [json.dumps({"pid": os.getpid(), "initialised_in": _state["initialised_in"]}) for _ in data]
"""


def test_a_handler_of_its_own_runs_in_a_host_of_its_own_as_mms_calls_it(server: RunningServer) -> None:
    """MMS's ``module:function`` handlers: initialised (``handle(None, context)``) and called as MMS's own worker
    would, in a device host of the model's own."""
    model_dir = server.model_dir("own_handler")
    model_dir.mkdir(parents=True)
    (model_dir / "own_handler_module.py").write_text(HANDLER_OF_ITS_OWN)
    assert server.load("own_handler", handler="own_handler_module:handle").status_code == 200

    response = server.invoke("own_handler", json.dumps(ROWS))

    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["pid"] == answer["initialised_in"] in server.worker_pids("own_handler")
    assert not server.shares_device_host("own_handler")
    assert "model=own_handler served by a device host of its own: its handler own_handler_module:handle" in (
        server.log_text()
    )
    assert server.unload("own_handler").status_code == 200


def test_one_model_runs_calls_from_several_workers_at_once(server: RunningServer) -> None:
    model_dir = model_factory.write_code(server.model_dir("parallel"), CONCURRENCY_SCRIPT).parent.parent
    assert server.load("parallel", initial_workers=3).status_code == 200
    with ThreadPoolExecutor(6) as pool:
        statuses = list(pool.map(lambda _: server.invoke("parallel", "x", "text/plain").status_code, range(12)))
    assert statuses == [200] * 12
    spans = [tuple(map(float, line.split())) for line in (model_dir / "spans.log").read_text().split("\n") if line]
    overlapping = max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans)
    assert overlapping >= 2  # stock MMS runs one call per worker at once; a device host must not serialise them
    assert server.unload("parallel").status_code == 200


def test_each_hosted_model_has_its_own_series_and_they_go_with_it(server: RunningServer) -> None:
    for name in ("counted_a", "counted_b"):
        model_factory.torchscript_model(server.model_dir(name))
        assert server.load(name).status_code == 200
    for _ in range(3):
        assert server.invoke("counted_a", json.dumps(ROWS)).status_code == 200
    assert server.invoke("counted_b", "[[1", "application/json").status_code == 400

    def requests_by_model() -> dict[tuple[str, str], float]:
        text = requests.get(server.metrics_url, timeout=10).text
        family = next(f for f in text_string_to_metric_families(text) if f.name == "mme_requests")
        return {(s.labels["model"], s.labels["code"]): s.value for s in family.samples if s.name.endswith("_total")}

    assert wait_until(lambda: requests_by_model().get(("counted_a", "200")) == 3, 10)
    counts = requests_by_model()
    assert counts[("counted_b", "400")] == 1 and ("counted_b", "200") not in counts
    assert server.unload("counted_a").status_code == 200
    assert wait_until(lambda: not any(model == "counted_a" for model, _ in requests_by_model()), 10)
    assert server.unload("counted_b").status_code == 200


def quarantines(server: RunningServer) -> dict[str, float]:
    text = requests.get(server.metrics_url, timeout=10).text
    family = next((f for f in text_string_to_metric_families(text) if f.name == "mme_model_quarantines"), None)
    samples = [] if family is None else family.samples
    return {s.labels["model"]: s.value for s in samples if s.name.endswith("_total")}


@pytest.fixture(scope="module")
def one_host_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    env = {"MME_TEST_PREDICT_SLEEP": "0", "MME_CPU_HOSTS": "1"}  # every model in the host the crasher kills
    with start_server(tmp_path_factory.mktemp("host-crash"), env) as running:
        yield running


@pytest.mark.parametrize("how", ["abort", "segfault"])
def test_a_model_that_kills_the_host_costs_the_others_seconds_then_leaves(
    one_host_server: RunningServer, how: str
) -> None:
    server = one_host_server
    neighbours = [f"{how}_neighbour{index}" for index in range(10)]
    for name in neighbours:
        model_factory.counting_model(server.model_dir(name))
        assert server.load(name).status_code == 200
    for name in (f"{how}_crasher", f"{how}_slow"):
        model_factory.write_code(server.model_dir(name), CRASHING_SCRIPT)
        assert server.load(name).status_code == 200
    crasher, slow = f"{how}_crasher", f"{how}_slow"
    body = json.dumps(ROWS)
    for name in neighbours:
        assert server.invoke(name, body).status_code == 200

    for crash in (1, 2):
        in_flight: list[tuple[int, float]] = []

        def wait_on_slow(results: list[tuple[int, float]] = in_flight) -> None:
            started = time.monotonic()
            response = server.invoke(slow, "sleep 30", "text/plain")
            results.append((response.status_code, time.monotonic() - started))

        waiting = threading.Thread(target=wait_on_slow)
        waiting.start()
        time.sleep(0.5)  # the slow call is running in the host
        assert server.invoke(crasher, how, "text/plain").status_code >= 500
        waiting.join(10)
        [(status, seconds)] = in_flight
        assert status >= 500 and seconds < 5.5  # answered at once, not after its 30 s

        started = time.monotonic()
        assert wait_until(lambda: all(server.invoke(n, body).status_code == 200 for n in neighbours), 10, 0.2)
        assert time.monotonic() - started < 10
        log = server.log_text()
        assert log.count(f"while running model {crasher} ") == crash  # the slow model's call was running too
        for name in neighbours:  # loaded again from their packages: model_fn ran once, at LOAD
            assert len(model_factory.model_fn_calls(server.model_dir(name))) == 1

    moved = f"model={crasher} served by a device host of its own: it crashed its device host 2 times"
    assert moved in server.log_text()
    assert wait_until(lambda: quarantines(server).get(crasher) == 1, 10)
    assert wait_until(lambda: server.invoke(crasher, "fine", "text/plain").status_code == 200, 10, 0.2)
    [host] = shared_hosts(server)
    assert server.invoke(crasher, how, "text/plain").status_code >= 500
    assert shared_hosts(server) == [host]  # its third crash is its own host's
    for name in neighbours:
        assert server.invoke(name, body).status_code == 200
    for name in (*neighbours, crasher, slow):
        server.unload(name)


def test_with_fake_gpus_exactly_one_host_per_card_binds_it(tmp_path_factory: pytest.TempPathFactory) -> None:
    gpus, workers = 2, 4
    env = {
        **fake_nvidia_smi.install(tmp_path_factory.mktemp("fake-gpus"), gpus),
        "SAGEMAKER_MODEL_SERVER_WORKERS": str(workers),
        "MME_TEST_PREDICT_SLEEP": "0.02",
    }
    with start_server(tmp_path_factory.mktemp("device-host-gpus"), env) as server:
        names = [f"gpu_model{index}" for index in range(20)]
        for name in names:
            model_factory.counting_model(server.model_dir(name))
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda name: server.load(name).status_code, names)) == [200] * 20
        cards = hosts(server)
        assert sorted(host.cmdline()[0] for host in cards) == [f"{HOST_TITLE} gpu={gpu}" for gpu in range(gpus)]
        host_pids = {host.pid for host in cards}
        for name in names:
            with ThreadPoolExecutor(workers * 2) as pool:
                answers = [r.json() for r in pool.map(server.invoke, [name] * 16, [json.dumps(ROWS)] * 16)]
            assert {a["pid"] for a in answers} == host_pids  # both cards serve it, one process each
            for answer in answers:
                assert answer["cuda_visible_devices"] == str(answer["gpu_id"])  # bound before any CUDA call
                assert answer["system_gpu_id"] == 0
            assert len(model_factory.model_fn_calls(server.model_dir(name))) == 1
        assert set(hosts(server)) == set(cards)


MARKING_SCRIPT = """
import builtins
import json
import os

# Imported at LOAD: in the model's loader, forked from the warm process, and again in the device host.
builtins.MME_TEST_MARK = getattr(builtins, "MME_TEST_MARK", ()) + ("{name}",)
with open(os.path.join(os.path.dirname(__file__), "imports.log"), "a") as log:
    log.write(json.dumps({{"pid": os.getpid(), "marks": list(builtins.MME_TEST_MARK)}}) + "\\n")


def model_fn(model_dir):
    return None


def transform_fn(model, body, content_type, accept):
    return json.dumps({{"module": __name__, "name": "{name}"}})
"""


def test_models_in_one_host_keep_their_own_functions_and_the_warm_process_stays_clean(
    one_host_server: RunningServer,
) -> None:
    server = one_host_server
    for name in ("first", "second"):
        model_factory.write_code(server.model_dir(name), MARKING_SCRIPT.format(name=name))
        assert server.load(name).status_code == 200
    first = server.invoke("first", b"{}").json()
    second = server.invoke("second", b"{}").json()
    assert (first["name"], second["name"]) == ("first", "second")  # the same inference.py name, each its own
    assert first["module"] != second["module"]
    [host] = [psutil.Process(pid) for pid in server.hosts_of("first")]
    warm = host.parent()
    assert warm is not None and "mme_runtime.processes.warm_start" in " ".join(warm.cmdline())
    for name in ("first", "second"):
        imports = [
            json.loads(line) for line in (server.model_dir(name) / "code" / "imports.log").read_text().splitlines()
        ]
        loader, in_host = imports
        assert loader["marks"] == [name]  # its loader, forked from the warm process, had nothing of the other
        assert in_host["pid"] == host.pid
    for name in ("first", "second"):
        assert server.unload(name).status_code == 200


def test_model_fn_that_initialises_cuda_runs_in_the_host(server: RunningServer) -> None:
    """The loader sees CUDA initialised (a test double here, a real ``.to("cuda")`` on a GPU): the model cannot
    travel, so the host runs model_fn itself, on its device."""
    model_dir = model_factory.counting_model(server.model_dir("cuda_in_loader"), fake_cuda_init=True)
    assert server.load("cuda_in_loader").status_code == 200
    answers = [server.invoke("cuda_in_loader", json.dumps(ROWS)).json() for _ in range(3)]
    [host] = server.hosts_of("cuda_in_loader")
    assert {a["pid"] for a in answers} == {host}
    calls = model_factory.model_fn_calls(model_dir)
    assert len(calls) == 2 and calls[1] == host  # the loader's, then the host's
    assert "model=cuda_in_loader model_fn runs in the device host: model_fn initialised CUDA" in server.log_text()
    assert server.unload("cuda_in_loader").status_code == 200


CUDA_OOM_IN_LOADER = """
import os

import torch
import mme_runtime.base.devices


def model_fn(model_dir):
    mme_runtime.base.devices.cuda_initialized = lambda: True  # test double of a .to("cuda") that ran
    tried = os.path.join(model_dir, os.pardir, "cuda_oom_tried")
    if not os.path.exists(tried):  # the first call, the loader's: its card (any of them) is full
        open(tried, "w").close()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    return torch.jit.load(os.path.join(model_dir, "model.pt"), map_location="cpu")
"""


def test_a_model_fn_that_fails_on_a_gpu_in_the_loader_runs_again_in_the_device_host(server: RunningServer) -> None:
    """The loader sees every card and took one that was full; the host, on its own card, runs model_fn again."""
    model_dir = model_factory.torchscript_model(server.model_dir("cuda_oom_in_loader"))
    model_factory.write_code(model_dir, CUDA_OOM_IN_LOADER)
    assert server.load("cuda_oom_in_loader").status_code == 200
    assert server.invoke("cuda_oom_in_loader", json.dumps(ROWS)).status_code == 200
    assert "model=cuda_oom_in_loader model_fn runs in the device host: model_fn initialised CUDA and failed here (" in (
        server.log_text()
    )
    assert server.unload("cuda_oom_in_loader").status_code == 200


def test_a_model_fn_with_threads_of_its_own_is_loaded_once(server: RunningServer) -> None:
    """What makes an isolated server fall back (model_fn left an OpenMP pool before fork) costs a host nothing:
    hosts are forked from the warm process, never from the process that ran model_fn."""
    model_dir = model_factory.wide_model(server.model_dir("own_threads"), threads=2)
    assert server.load("own_threads").status_code == 200
    rows = json.dumps([[0.001 * i] * model_factory.WIDE_FEATURES for i in range(64)])
    assert all(server.invoke("own_threads", rows).status_code == 200 for _ in range(4))
    assert len(model_factory.model_fn_calls(model_dir)) == 1
    assert server.unload("own_threads").status_code == 200


def test_the_same_artifacts_under_two_names_share_one_package(server: RunningServer) -> None:
    model_dir = model_factory.torchscript_model(server.model_dir("artifacts"))
    assert server.load("one", model_dir).status_code == 200
    assert server.load("two", model_dir).status_code == 200
    for name in ("one", "two"):
        np.testing.assert_allclose(np.array(server.invoke(name, json.dumps(ROWS)).json()), expected(0), rtol=1e-5)
    log = server.log_text()
    assert f"model cache hit {model_dir / 'model.pt'}: model=two shares its package" in log
    assert "model=one loaded seconds=" in log and "model=two loaded seconds=" not in log  # no loader for two
    assert "model=two takes the model its package already gave this host (one copy)" in log
    assert server.unload("one").status_code == 200
    assert server.invoke("two", json.dumps(ROWS)).status_code == 200  # still its, until it goes too
    assert server.unload("two").status_code == 200
    assert wait_until(lambda: f"model cache keeps {model_dir / 'model.pt'}" in server.log_text(), 10)  # for a re-LOAD

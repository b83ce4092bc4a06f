"""Long LOADs (issue #29): a `model_fn` that runs past ``SAGEMAKER_MODEL_SERVER_TIMEOUT`` loads through the real
frontend, while the models already loaded answer at once.

SageMaker lets a LOAD run up to 360 s; MMS times the LOAD with the timer it uses for every request, which our
frontend settings never set below that (``mme_runtime/processes/frontend.py``, ``LOAD_SECONDS``), whatever
``SAGEMAKER_MODEL_SERVER_TIMEOUT`` says. The server here sets that timeout to a few seconds, so that a `model_fn` a
little longer shows what a 90 s one does against the default 60 s without the wait. MMS's own fixed timers (a model's
process must say it started within a minute) are checked by order: the frontend reads "MMS worker started." before
`model_fn` ends, so they never time `model_fn`, however long it takes.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator

import model_factory
import pytest
import requests
from serving import RunningServer, start_server, wait_until

pytestmark = pytest.mark.slow

MODEL_SERVER_TIMEOUT_SECONDS = 3  # SAGEMAKER_MODEL_SERVER_TIMEOUT here, in place of its default 60
LOAD_SLEEP_SECONDS = 7  # well past it, as a 90 s model_fn is past the default
STARTED_LINE = "MMS worker started."  # what the frontend reads on the model's stdout (WorkerLifeCycle)
ROWS = json.dumps([[1.0, 2.0, 3.0, 4.0]])

SLOW_SCRIPT = f"""
import json
import os
import time


def model_fn(model_dir):
    time.sleep({LOAD_SLEEP_SECONDS})
    return {{"name": os.path.basename(model_dir)}}


def transform_fn(model, body, content_type, accept):
    return json.dumps({{"model": model["name"]}}), "application/json"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    env = {"SAGEMAKER_MODEL_SERVER_TIMEOUT": str(MODEL_SERVER_TIMEOUT_SECONDS)}
    with start_server(tmp_path_factory.mktemp("long-load"), env) as running:
        yield running


def post_load(server: RunningServer, name: str) -> tuple[int, float]:
    """LOAD as SageMaker sends it, with a client that waits as long as SageMaker does (360 s)."""
    started = time.monotonic()
    body = {"model_name": name, "url": str(server.model_dir(name))}
    response = requests.post(f"{server.url}/models", json=body, timeout=360)
    return response.status_code, time.monotonic() - started


def test_a_load_past_the_timeout_succeeds_while_loaded_models_answer_at_once(server: RunningServer) -> None:
    model_factory.torchscript_model(server.model_dir("fast"))
    model_factory.torchscript_model(server.model_dir("fast-own"), seed=1)
    (server.model_dir("fast-own") / "serving.properties").write_text("isolation=process\n")
    for name in ("fast", "fast-own"):
        assert server.load(name).status_code == 200
    model_factory.torchscript_model(server.model_dir("late"), seed=2)
    for name in ("slow", "slow-own"):
        model_factory.write_code(server.model_dir(name), SLOW_SCRIPT)
    (server.model_dir("slow-own") / "serving.properties").write_text("isolation=process\n")

    loads: dict[str, tuple[int, float]] = {}
    early_invoke: dict[str, tuple[int, float, str]] = {}

    def load(name: str) -> None:
        loads[name] = post_load(server, name)

    def registered() -> bool:
        # Known, and given its worker: in between, MMS answers an INVOKE 503 "No worker is available" (three times in
        # fresh-clone runs of the whole suite, where the worker came a moment later).
        descriptions = [server.describe(name) for name in ("slow", "slow-own")]
        return all(described.status_code == 200 and described.json().get("workers") for described in descriptions)

    def invoke_while_loading() -> None:
        # MMS holds it until the LOAD ends (for good, if the LOAD fails): the client gives up soon after.
        started = time.monotonic()
        try:
            response = requests.post(
                f"{server.url}/models/slow/invoke",
                data="x",
                headers={"Content-Type": "text/plain"},
                timeout=LOAD_SLEEP_SECONDS + 30,
            )
        except requests.RequestException:
            return
        early_invoke["slow"] = response.status_code, time.monotonic() - started, response.text[:300]

    threads = [threading.Thread(target=load, args=(name,)) for name in ("slow", "slow-own")]
    for thread in threads:
        thread.start()
    assert wait_until(registered, 30)  # their model_fn sleeping from now on
    # What a retried LOAD gets meanwhile, and an INVOKE sent before the LOAD answered: MMS queues it.
    assert post_load(server, "slow")[0] == 409
    waiting = threading.Thread(target=invoke_while_loading, daemon=True)
    waiting.start()
    late = post_load(server, "late")  # another model's LOAD is not held up behind theirs
    assert late[0] == 200 and late[1] < 30
    assert requests.get(f"{server.url}/ping", timeout=2).status_code == 200

    latencies: dict[str, list[float]] = {"fast": [], "fast-own": []}
    while any(thread.is_alive() for thread in threads):
        for name, seconds in latencies.items():
            started = time.monotonic()
            response = server.invoke(name, ROWS)
            seconds.append(time.monotonic() - started)
            assert response.status_code == 200, f"{name}: {response.status_code} {response.text}"
        time.sleep(0.25)
    for thread in threads:
        thread.join()
    for name in ("slow", "slow-own"):
        status, seconds = loads[name]
        assert status == 200, f"{name}: LOAD answered {status} after {seconds:.1f} s"
        assert seconds >= LOAD_SLEEP_SECONDS > MODEL_SERVER_TIMEOUT_SECONDS
        response = server.invoke(name, "x", content_type="text/plain")
        assert response.status_code == 200 and response.json() == {"model": name}
    waiting.join(30)
    # What MMS said, and when, is kept.
    assert early_invoke.get("slow", (None,))[0] == 200, early_invoke

    all_latencies = sorted(seconds for series in latencies.values() for seconds in series)
    print(
        f"\nLOADs of a {LOAD_SLEEP_SECONDS} s model_fn: shared {loads['slow'][1]:.1f} s, isolated "
        f"{loads['slow-own'][1]:.1f} s; another model's LOAD meanwhile {late[1]:.1f} s; {len(all_latencies)} "
        f"INVOKEs of loaded models meanwhile, median {statistics.median(all_latencies) * 1000:.1f} ms, max "
        f"{all_latencies[-1] * 1000:.1f} ms; an INVOKE sent during the LOAD answered after "
        f"{early_invoke['slow'][1]:.1f} s"
    )
    assert len(all_latencies) >= 2 * LOAD_SLEEP_SECONDS  # two a second or so, all along the LOADs
    assert statistics.median(all_latencies) < 0.25 and all_latencies[-1] < 1.0
    assert server.shares_device_host("slow") and not server.shares_device_host("slow-own")
    log = server.log_text()
    assert "did not respond in given time" not in log
    for name in ("slow", "slow-own"):
        # On the model's stdout as MMS relays it, in the order written: started (MMS's start timer stops), then
        # model_fn's end. So that timer never counts model_fn, whatever it takes.
        lines = [line for line in log.splitlines() if f"-{name}-stdout " in line]
        started = next(i for i, line in enumerate(lines) if line.endswith(STARTED_LINE))
        loaded = next(i for i, line in enumerate(lines) if f"model={name} loaded seconds=" in line)
        assert started < loaded, "\n".join(lines)

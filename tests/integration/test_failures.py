"""Failures that explain themselves (issue #29), through the real frontend: each class of failure has its own words in
the log line (``model=NAME gpu=G load failed status=S: CAUSE``, ``model=NAME request=ID status=S: CAUSE``, ``device
host pid=P gpu=G killed by SIGNAL ... while running model NAME``) and, where MMS carries them, in the answer.
docs/troubleshooting.md lists every message; this file keeps them true.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import fake_nvidia_smi
import model_factory
import pytest
import requests
from serving import RunningServer, start_server, wait_until

INVOKE_TIMEOUT_SECONDS = 8  # SAGEMAKER_MODEL_SERVER_TIMEOUT here: longer than any LOAD below takes
PIP_TIMEOUT_SECONDS = 2
S3_TIMEOUT_SECONDS = 1
HOST_NUMBERS = r"host memory: \d+ MiB available of \d+ MiB"

SCRIPT = """
import os
import signal
import time

import torch


def model_fn(model_dir):
    return None


def input_fn(body, content_type):
    return body.decode() if isinstance(body, (bytes, bytearray)) else str(body)


def predict_fn(text, model):
    if text == "memory":
        raise MemoryError()
    if text == "cuda":
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity")
    if text == "abort":
        os.abort()
    if text == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if text.startswith("sleep"):
        time.sleep(float(text.split()[1]))
    return {"ok": True}


def output_fn(prediction, accept):
    return '{"ok": true}', "application/json"
"""


def model_fn_raising(statement: str) -> str:
    """A script whose ``model_fn`` runs ``statement`` (one line)."""
    transform_fn = "def transform_fn(model, body, content_type, accept):\n    return '{}'\n"
    return f"def model_fn(model_dir):\n    {statement}\n\n\n{transform_fn}"


@pytest.fixture(scope="module")
def silent_port() -> Iterator[int]:
    """A port that takes connections and never answers: an index or S3 endpoint that hangs."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, silent_port: int) -> Iterator[RunningServer]:
    env = {
        "SAGEMAKER_MODEL_SERVER_TIMEOUT": str(INVOKE_TIMEOUT_SECONDS),
        "MME_PIP_TIMEOUT_SECONDS": str(PIP_TIMEOUT_SECONDS),
        "MME_S3_TIMEOUT_SECONDS": str(S3_TIMEOUT_SECONDS),
        # Only for models with no code/ of their own: the S3 test's; every other model here has its own.
        "SAGEMAKER_SUBMIT_DIRECTORY": "s3://code/inference.tar.gz",
        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{silent_port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "MME_TEST_PREDICT_SLEEP": "0",
    }
    with start_server(tmp_path_factory.mktemp("failures"), env) as running:
        yield running


def logged(server: RunningServer, pattern: str, timeout: float = 10) -> str:
    """The first log line matching ``pattern`` (a regex), waited for."""
    compiled = re.compile(pattern)

    def find() -> str | None:
        return next((line for line in server.log_text().splitlines() if compiled.search(line)), None)

    assert wait_until(lambda: find() is not None, timeout), f"no log line matches {pattern!r}"
    return str(find())


def test_a_model_larger_than_host_memory_answers_507_and_says_what_it_needs(server: RunningServer) -> None:
    model_dir = model_factory.write_code(server.model_dir("huge"), SCRIPT).parent.parent
    with open(model_dir / "weights.bin", "wb") as sparse:  # 1 TiB on paper
        sparse.truncate(1 << 40)
    assert server.load("huge").status_code == 507
    logged(
        server,
        r"model=huge gpu=None load failed status=507: out of host memory: needs about \d+ MiB \(the model's 1048576 "
        r"MiB \+ MME_MEMORY_HEADROOM_MB=256\), \d+ MiB available on the host$",
    )


@pytest.mark.parametrize(
    ("name", "statement", "cause"),
    [
        ("oom_host", "raise MemoryError()", rf"out of host memory in model_fn: MemoryError \({HOST_NUMBERS}"),
        (
            "oom_gpu",
            "import torch; raise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. More')",
            r"out of GPU memory in model_fn: CUDA out of memory\. Tried to allocate 2\.00 GiB$",  # no CUDA here
        ),
    ],
)
def test_running_out_of_memory_in_model_fn_answers_507_in_words(
    server: RunningServer, name: str, statement: str, cause: str
) -> None:
    model_factory.write_code(server.model_dir(name), model_fn_raising(statement))
    assert server.load(name).status_code == 507
    logged(server, rf"model={name} gpu=None load failed status=507: {cause}")


def test_a_missing_package_fails_the_load_and_points_at_requirements_txt(server: RunningServer) -> None:
    model_factory.write_code(server.model_dir("missing"), "import mme_no_such_package\n" + SCRIPT)
    assert server.load("missing").status_code == 500
    logged(
        server,
        r"model=missing gpu=None load failed status=500: import error in code/inference\.py: No module named "
        r"'mme_no_such_package' \(add the package that provides it to code/requirements\.txt, or the module to code/\)",
    )


def test_an_exception_in_model_fn_is_named_with_its_traceback_in_the_log_only(server: RunningServer) -> None:
    model_factory.write_code(server.model_dir("raises"), model_fn_raising("raise ValueError('bad config: layers=0')"))
    response = server.load("raises")
    assert response.status_code == 500
    assert "Traceback" not in response.text and "layers=0" not in response.text  # MMS's own words reach the client
    line = logged(server, r"model=raises gpu=None load failed status=500: model_fn raised ValueError: bad config")
    log = server.log_text()
    after = log[log.index(line) :]
    assert "Traceback (most recent call last)" in after and "code/inference.py" in after


def test_a_requirements_install_over_its_time_fails_the_load_naming_the_setting(
    server: RunningServer, silent_port: int
) -> None:
    model_dir = model_factory.write_code(server.model_dir("slow_pip"), SCRIPT).parent.parent
    requirements = f"--index-url http://127.0.0.1:{silent_port}/simple\nmme-no-such-package==1.0\n"
    (model_dir / "code" / "requirements.txt").write_text(requirements)
    started = time.monotonic()
    assert server.load("slow_pip").status_code == 500
    assert time.monotonic() - started < PIP_TIMEOUT_SECONDS + 10
    logged(
        server,
        rf"model=slow_pip gpu=None load failed status=500: timed out after {PIP_TIMEOUT_SECONDS} s "
        r"\(MME_PIP_TIMEOUT_SECONDS\): pip install -r .*/slow_pip/code/requirements\.txt$",
    )


def test_code_from_s3_that_does_not_arrive_in_time_fails_the_load_naming_the_setting(server: RunningServer) -> None:
    model_factory.torchscript_model(server.model_dir("s3_code"))  # no code/: SAGEMAKER_SUBMIT_DIRECTORY's is fetched
    assert server.load("s3_code").status_code == 500
    logged(
        server,
        r"model=s3_code gpu=None load failed status=500: timed out after \d+ s \(MME_S3_TIMEOUT_SECONDS="
        rf"{S3_TIMEOUT_SECONDS} per call, 2 attempts\): fetching s3://code/inference\.tar\.gz$",
    )


@pytest.fixture(scope="module")
def serving_model(server: RunningServer) -> str:
    model_factory.write_code(server.model_dir("serving"), SCRIPT)
    assert server.load("serving").status_code == 200
    return "serving"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("memory", rf"out of host memory in predict_fn: MemoryError \({HOST_NUMBERS}.*\)"),
        ("cuda", r"out of GPU memory in predict_fn: CUDA out of memory\. Tried to allocate 20\.00 GiB"),
    ],
)
def test_out_of_memory_in_predict_fn_answers_507_in_words_and_the_model_keeps_serving(
    server: RunningServer, serving_model: str, body: str, message: str
) -> None:
    response = server.invoke(serving_model, body, "text/plain")
    assert response.status_code == 507
    answer = response.json()
    assert answer["type"] == "InsufficientMemory" and re.fullmatch(message, answer["message"]), answer
    assert "Traceback" not in response.text
    logged(server, rf"model={serving_model} request={answer['request_id']} status=507: {message}$")
    assert server.invoke(serving_model, "fine", "text/plain").status_code == 200


def test_an_invoke_over_the_model_server_timeout_answers_504_and_the_model_serves_again(
    server: RunningServer, serving_model: str
) -> None:
    started = time.monotonic()
    response = server.invoke(serving_model, f"sleep {INVOKE_TIMEOUT_SECONDS + 4}", "text/plain")
    assert INVOKE_TIMEOUT_SECONDS - 2 < time.monotonic() - started < INVOKE_TIMEOUT_SECONDS + 2
    assert response.status_code == 504
    expected = f"timed out after {INVOKE_TIMEOUT_SECONDS} s (SAGEMAKER_MODEL_SERVER_TIMEOUT): predict_fn still running"
    assert response.json()["message"] == expected
    logged(server, rf"model={serving_model} request=\S+ status=504: {re.escape(expected)}$")
    assert wait_until(lambda: server.invoke(serving_model, "fine", "text/plain").status_code == 200, 15, 0.5)


def crash_line(server: RunningServer, name: str, signal_name: str) -> str:
    return logged(
        server, rf"device host pid=\d+ gpu=cpu=\d killed by {signal_name}.* while running model {name} ", timeout=15
    )


def test_a_model_that_aborts_its_host_is_named_with_the_signal_and_its_stack(server: RunningServer) -> None:
    model_factory.write_code(server.model_dir("aborts"), SCRIPT)
    assert server.load("aborts").status_code == 200
    response = server.invoke("aborts", "abort", "text/plain")
    assert response.status_code == 500 and response.json()["message"] == "Worker died."  # MMS's words, not ours
    line = crash_line(server, "aborts", "SIGABRT")
    assert line.endswith("(calls running: aborts); the other models load again from their packages")
    stack = logged(server, r"device host pid=\d+: the thread that crashed, most recent call first:")
    log = server.log_text()
    assert re.search(r"File \".*/aborts/code/inference\.py\", line \d+ in predict_fn", log[log.index(stack) :])


def test_a_host_killed_by_sigkill_says_whether_it_was_the_kernel_s_oom_killer(server: RunningServer) -> None:
    for name in ("kills_itself", "killed_outside"):
        model_factory.write_code(server.model_dir(name), SCRIPT)
        assert server.load(name).status_code == 200
    assert server.invoke("kills_itself", "kill", "text/plain").status_code == 500
    # The count the kernel keeps went up (OOM), did not (as here), or cannot be read: the line says which.
    why = r"\((out of memory: the kernel's out-of-memory killer ran|not by the kernel's|often the kernel's)"
    assert re.search(rf"killed by SIGKILL {why}", crash_line(server, "kills_itself", "SIGKILL"))

    assert wait_until(lambda: server.invoke("killed_outside", "fine", "text/plain").status_code == 200, 15, 0.5)
    [host] = server.hosts_of("killed_outside")
    waiting: list[requests.Response] = []
    caller = threading.Thread(target=lambda: waiting.append(server.invoke("killed_outside", "sleep 5", "text/plain")))
    caller.start()
    time.sleep(1)
    os.kill(host, signal.SIGKILL)  # as the kernel's out-of-memory killer would
    caller.join(10)
    assert [response.status_code for response in waiting] == [500]
    line = crash_line(server, "killed_outside", "SIGKILL")
    assert re.search(rf"device host pid={host} gpu=cpu=\d killed by SIGKILL {why}", line)
    assert wait_until(lambda: server.invoke("killed_outside", "fine", "text/plain").status_code == 200, 15, 0.5)


def test_a_loader_killed_by_a_signal_is_named_with_it_and_its_stack(server: RunningServer) -> None:
    model_factory.write_code(server.model_dir("segfaults"), model_fn_raising("import ctypes; ctypes.string_at(0)"))
    assert server.load("segfaults").status_code == 500
    logged(server, r"model=segfaults load failed: its loader pid=\d+ killed by SIGSEGV$")
    assert re.search(r"File \".*/segfaults/code/inference\.py\", line 2 in model_fn", server.log_text())


def test_a_gpu_without_room_answers_507_with_the_card_s_numbers(tmp_path_factory: pytest.TempPathFactory) -> None:
    fake = tmp_path_factory.mktemp("fake-gpu")
    env = {**fake_nvidia_smi.install(fake, 1), fake_nvidia_smi.FREE_VARIABLE: "10", "MME_TEST_PREDICT_SLEEP": "0"}
    with start_server(tmp_path_factory.mktemp("no-room"), env) as server:
        for name, properties in (("shared", ""), ("isolated", "isolation=process\n")):
            model_factory.torchscript_model(server.model_dir(name))
            (server.model_dir(name) / "serving.properties").write_text(properties)
            assert server.load(name).status_code == 507
            logged(
                server,
                rf"model={name} gpu=0 load failed status=507: out of GPU memory: needs about 256 MiB \(the model's 0 "
                r"MiB \+ MME_MEMORY_HEADROOM_MB=256\), 10 MiB free on GPU 0 \(nvidia-smi\)$",
            )


def test_the_troubleshooting_page_lists_every_class() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md").read_text()
    for words in (
        "load failed status=507: out of host memory: needs about",
        "load failed status=507: out of GPU memory: needs about",
        "out of host memory in model_fn",
        "out of GPU memory in predict_fn",
        "import error in code/inference.py",
        "model_fn raised ValueError",
        "timed out after 300 s (MME_PIP_TIMEOUT_SECONDS)",
        "(MME_S3_TIMEOUT_SECONDS=30 per call, 2 attempts)",
        "(SAGEMAKER_MODEL_SERVER_TIMEOUT): predict_fn still running",
        "killed by SIGKILL (out of memory: the kernel's out-of-memory killer ran",
        "its loader pid=",
        "Worker died.",
    ):
        assert words in page, words

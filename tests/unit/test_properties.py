from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from mme_runtime.base.config import Config
from mme_runtime.base.parsing import read_properties
from mme_runtime.processes.frontend import (
    ensure_mme_properties,
    frontend_command,
    jvm_arguments,
    mms_properties,
    prepare_mms_home,
    write_properties,
)
from mme_runtime.processes.warm_protocol import STARTING_FILE, receive

TEMPLATE = Path(__file__).resolve().parents[2] / "mme-mms.properties"


def test_preload_key_is_added_once_however_often_it_starts(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "mme-mms.properties"
    for _ in range(3):
        properties = ensure_mme_properties(path, TEMPLATE)
    assert properties["preload_model_gpu"] == "true"
    assert path.read_text().splitlines().count("preload_model_gpu=true") == 1


def test_a_value_the_user_set_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "mme-mms.properties"
    path.write_text("preload_model_gpu=false")  # no trailing newline
    assert ensure_mme_properties(path, TEMPLATE)["preload_model_gpu"] == "false"
    assert path.read_text() == "preload_model_gpu=false"


def test_mms_properties_derive_addresses_workers_and_limits() -> None:
    config = Config.from_env({"SAGEMAKER_BIND_TO_PORT": "9000", "SAGEMAKER_MODEL_SERVER_TIMEOUT": "120"})
    properties = mms_properties(config, {"preload_model_gpu": "true", "async_logging": "true"}, workers_per_model=2)
    assert properties["inference_address"] == properties["management_address"] == "http://0.0.0.0:9000"
    assert properties["default_workers_per_model"] == "2"
    assert properties["model_store"] == "/"
    assert "preload_model_gpu" not in properties and properties["async_logging"] == "true"


def test_the_frontend_has_event_loops_to_spare_for_unloads_unless_the_user_says_otherwise() -> None:
    # An UNLOAD holds its event loop until the model's process is reaped; netty's default, 2 a core, made a model
    # invoked meanwhile wait for it.
    ours = mms_properties(Config(), {}, workers_per_model=1)
    assert int(ours["number_of_netty_threads"]) >= 32
    users = mms_properties(Config(), {"number_of_netty_threads": "4"}, workers_per_model=1)
    assert users["number_of_netty_threads"] == "4"


def test_mms_timer_never_cuts_a_load_shorter_than_sagemaker_allows() -> None:
    # MMS times a LOAD with the request timer: SAGEMAKER_MODEL_SERVER_TIMEOUT below 360 s must not shorten LOADs.
    for timeout, timer in (("60", "360"), ("120", "360"), ("600", "600")):
        config = Config.from_env({"SAGEMAKER_MODEL_SERVER_TIMEOUT": timeout})
        assert mms_properties(config, {}, workers_per_model=1)["default_response_timeout_seconds"] == timer


def test_properties_are_written_atomically_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "mms.properties"
    write_properties(path, {"a": "1", "b": "x=y"})
    assert read_properties(path) == {"a": "1", "b": "x=y"}
    assert not list(tmp_path.glob("*.tmp"))


def test_mms_home_runs_our_backend_and_keeps_mms_metrics(tmp_path: Path) -> None:
    home = prepare_mms_home(tmp_path)
    prepare_mms_home(tmp_path)  # idempotent
    stub = (home / "mms" / "model_service_worker.py").read_text()
    assert "warm_stub.run_via_warm_process(" in stub
    assert (home / "mms" / "metrics" / "metric_collector.py").is_file()


def test_a_stub_with_no_warm_process_fails_its_model_and_says_why(tmp_path: Path) -> None:
    home = prepare_mms_home(tmp_path)
    env = {**os.environ, "MME_RUNTIME_DIR": str(tmp_path)}  # no warm.sock there
    arguments = ["--model-name", "m", "--model-path", str(tmp_path)]
    script = str(home / "mms" / "model_service_worker.py")
    stub = subprocess.run([sys.executable, script, *arguments], env=env, capture_output=True, text=True, timeout=60)
    assert stub.returncode == 1
    assert f"no warm process at {tmp_path / 'warm.sock'}" in stub.stderr


def test_a_stub_started_while_the_warm_process_starts_waits_for_it(tmp_path: Path) -> None:
    # MMS and the warm process start at once: a model MMS starts first waits for the warm process to accept.
    home = prepare_mms_home(tmp_path)
    (tmp_path / STARTING_FILE).touch()
    env = {**os.environ, "MME_RUNTIME_DIR": str(tmp_path)}
    script = str(home / "mms" / "model_service_worker.py")
    arguments = ["--model-name", "m", "--model-path", str(tmp_path)]
    stub = subprocess.Popen([sys.executable, script, *arguments], env=env, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1)
        assert stub.poll() is None  # still waiting, where with no warm process starting it fails at once
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(tmp_path / "warm.sock"))
            listener.listen()
            listener.settimeout(30)
            connection, _ = listener.accept()
            with connection:
                request, fds = receive(connection, with_fds=3)
                for fd in fds:
                    os.close(fd)
        assert request is not None and request["argv"][-len(arguments) :] == arguments
        _, stderr = stub.communicate(timeout=30)
    finally:
        stub.kill()
    assert stub.returncode == 1 and "the warm process ended before it took the model" in stderr


def test_frontend_command_starts_java_with_our_properties_and_python(tmp_path: Path) -> None:
    config = Config.from_env({"MME_RUNTIME_DIR": str(tmp_path), "JAVA_HOME": "/opt/jdk"})
    command = frontend_command(config, tmp_path / "mms.properties", tmp_path / "home", "-Xmx1g")
    assert command[0] == "/opt/jdk/bin/java"
    assert "-Xmx1g" in command and "com.amazonaws.ml.mms.ModelServer" in command
    assert command[-2:] == ["-f", str(tmp_path / "mms.properties")]
    assert f"-Djava.io.tmpdir={tmp_path / 'tmp'}" in command


def test_the_frontend_s_heap_is_capped_unless_the_user_says_otherwise() -> None:
    assert jvm_arguments(Config(), {}) == "-XX:+UseContainerSupport -XX:MaxRAMPercentage=10.0"
    assert jvm_arguments(Config(), {"vmargs": "-Xmx512m"}) == "-Xmx512m"  # the MME properties file's
    assert (
        jvm_arguments(Config.from_env({"SAGEMAKER_MODEL_SERVER_VMARGS": " -Xmx2g "}), {"vmargs": "-Xmx512m"})
        == "-Xmx2g"
    )

from __future__ import annotations

import ast
import logging
import os
from pathlib import Path

import pytest

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ConfigError
from mme_runtime.base.settings import SETTINGS

REPO = Path(__file__).resolve().parents[2]


def test_defaults_match_the_sagemaker_contract() -> None:
    config = Config.from_env({})
    assert config.port == 8080
    assert config.multi_model is True
    assert config.workers_per_model is None
    assert config.default_accept == "application/json"
    assert config.effective_properties_file == Path("/tmp/mme/mme-mms.properties")


def test_values_are_parsed_from_the_environment() -> None:
    config = Config.from_env(
        {
            "SAGEMAKER_BIND_TO_PORT": "9090",
            "SAGEMAKER_MODEL_SERVER_WORKERS": "3",
            "SAGEMAKER_CONTAINER_LOG_LEVEL": "debug",
            "SAGEMAKER_MAX_PAYLOAD_IN_MB": "10",
            "MME_LOAD_MODELS": "a=/m/a, b=/m/b",
        }
    )
    assert (config.port, config.workers_per_model, config.log_level) == (9090, 3, logging.DEBUG)
    assert config.max_request_bytes == 10 * 1024 * 1024
    assert config.load_models == (("a", "/m/a"), ("b", "/m/b"))


def test_sagemaker_inference_s_timeout_in_seconds_wins() -> None:
    both = {"SAGEMAKER_MODEL_SERVER_TIMEOUT": "60", "SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS": "420"}
    assert Config.from_env(both).response_timeout_seconds == 420
    assert Config.from_env({"SAGEMAKER_MODEL_SERVER_TIMEOUT": "90"}).response_timeout_seconds == 90


def test_request_size_in_bytes_wins_over_megabytes() -> None:
    config = Config.from_env({"SAGEMAKER_MAX_PAYLOAD_IN_MB": "10", "SAGEMAKER_MAX_REQUEST_SIZE": "1000"})
    assert config.max_request_bytes == 1000


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SAGEMAKER_BIND_TO_PORT", "32767"),
        ("SAGEMAKER_BIND_TO_PORT", "http"),
        ("SAGEMAKER_MODEL_SERVER_WORKERS", "0"),
        ("SAGEMAKER_MULTI_MODEL", "sometimes"),
        ("SAGEMAKER_CONTAINER_LOG_LEVEL", "LOUD"),
        ("MME_CPU_HOSTS", "0"),
        ("MME_LOAD_MODELS", "just-a-name"),
    ],
)
def test_bad_values_raise_config_error_naming_variable_and_value(variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as error:
        Config.from_env({variable: value})
    assert variable in str(error.value) and value in str(error.value)


@pytest.mark.parametrize("variable", ["MME_PRELOAD_MODEL_GPU", "MME_START_METHOD", "MME_WARM_START"])
def test_a_retired_setting_is_refused_naming_what_replaced_it(variable: str) -> None:
    for value in ("true", "false"):  # whatever it says: the process tree it chose no longer exists
        with pytest.raises(ConfigError) as error:
            Config.from_env({variable: value})
        assert f"{variable}={value} is no longer read: " in str(error.value)
        assert "retired-settings" in str(error.value)
    assert "device host of its own" in str(pytest.raises(ConfigError, Config.from_env, {"MME_WARM_START": "0"}).value)
    assert Config.from_env({variable: " "}) == Config.from_env({})  # set but empty: as if unset


def test_preload_off_in_the_properties_file_is_refused() -> None:
    assert Config.from_env({}).with_properties({}) == Config.from_env({})
    assert Config.from_env({}).with_properties({"preload_model_gpu": "true"}) == Config.from_env({})
    with pytest.raises(ConfigError) as error:
        Config.from_env({}).with_properties({"preload_model_gpu": "false"})
    assert "preload_model_gpu=false in /tmp/mme/mme-mms.properties is no longer read" in str(error.value)


def test_to_env_round_trips_what_backends_need() -> None:
    config = Config.from_env({"SAGEMAKER_PROGRAM": "serve.py", "MME_SHARE_DEVICE": "false"}).with_properties({})
    again = Config.from_env(config.to_env())
    assert (again.program, again.share_device) == ("serve.py", False)


def test_idle_openmp_threads_sleep_unless_the_user_chose_otherwise() -> None:
    assert Config.from_env({}).to_env()["OMP_WAIT_POLICY"] == "PASSIVE"
    assert Config.from_env({"OMP_WAIT_POLICY": "ACTIVE"}).to_env()["OMP_WAIT_POLICY"] == "ACTIVE"
    assert Config.from_env({}).to_env()["GOMP_SPINCOUNT"] == "10000"  # ... after a short spin between ops


def test_every_variable_names_a_config_field_and_is_listed_once() -> None:
    fields = set(Config.__dataclass_fields__)
    assert {setting.field for setting in SETTINGS} <= fields
    names = [setting.name for setting in SETTINGS]
    assert len(names) == len(set(names))


WRITES = ("clear", "update")  # replacing the environment (the warm process does) is not reading it


def _reads_environment(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        is_os = isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "os"
        if not (is_os and node.attr in ("environ", "getenv")):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store):
            continue  # os.environ[...] = value
        if isinstance(parent, ast.Attribute) and parent.attr in WRITES:
            continue
        return True
    return False


def test_only_config_reads_the_environment() -> None:
    modules = [*sorted((REPO / "mme_runtime").rglob("*.py")), REPO / "handler_service.py"]
    modules.append(REPO / "inference_handler.py")
    offenders = [p.name for p in modules if p.name != "config.py" and _reads_environment(p)]
    assert offenders == []


def test_the_configuration_page_is_the_generated_one() -> None:
    from mme_runtime.base.settings import configuration_page

    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == configuration_page(), (
        "regenerate with: .venv/bin/python -m mme_runtime.base.settings > docs/configuration.md"
    )


def test_mkl_gives_its_buffers_back_unless_the_user_chose_otherwise() -> None:
    # Kept per thread, they cost each model of a device host about 1 MiB (its passes run on threads of its own).
    assert Config.from_env({}).to_env()["MKL_DISABLE_FAST_MM"] == "1"
    assert Config.from_env({"MKL_DISABLE_FAST_MM": "0"}).to_env()["MKL_DISABLE_FAST_MM"] == "0"


def test_kept_packages_default_to_a_sixteenth_of_the_container_s_memory_at_most_2_gib(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mme_runtime.base import config as config_module

    for limit_mib, kept in ((4096, 256), (16384, 1024), (65536, 2048)):
        monkeypatch.setattr(config_module, "cgroup_memory", lambda limit=limit_mib: (0, limit * 2**20))
        assert Config.from_env({}).keep_unloaded_mb == kept
    assert Config.from_env({"MME_KEEP_UNLOADED_MB": "3000"}).keep_unloaded_mb == 3000  # as set, whatever the memory


def test_the_entrypoint_alone_runs_on_glibc_s_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONMALLOC", raising=False)
    again = Config.from_env({}).entrypoint_environment()
    assert again is not None and again["PYTHONMALLOC"] == "malloc"
    monkeypatch.setattr(os, "environ", again)
    executed = Config.from_process_env()
    assert executed.entrypoint_environment() is None  # once
    children = executed.child_environment()
    assert "PYTHONMALLOC" not in children and "MME_ENTRYPOINT_MALLOC" not in children


def test_a_user_s_allocator_is_every_process_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONMALLOC", "pymalloc_debug")
    config = Config.from_process_env()
    assert config.entrypoint_environment() is None
    assert config.child_environment()["PYTHONMALLOC"] == "pymalloc_debug"
    monkeypatch.setenv("MME_ENTRYPOINT_MALLOC", "true")  # never the user's to set, but set
    assert Config.from_process_env().child_environment()["PYTHONMALLOC"] == "pymalloc_debug"

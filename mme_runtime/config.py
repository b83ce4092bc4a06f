"""Every setting the container reads, in one frozen object built from an environment mapping.

This is the only module that reads ``os.environ``; everything else receives a ``Config``. It never imports torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mme_runtime.errors import ConfigError

StartMethod = Literal["fork", "spawn"]

# MMS 1.1.11 refuses ports at or above 32767 ("Invalid port number").
MAX_MMS_PORT = 32766
MIB = 1024 * 1024
# Bounds of the batching settings, wherever they come from (environment, serving.properties).
MAX_BATCH_SIZE = 1024
MAX_BATCH_DELAY_MS = 60_000
MAX_CONCURRENCY = 256
INHERITED_LISTEN_FD = "MME_BACKEND_LISTEN_FD"
INHERITED_LIFELINE_FD = "MME_BACKEND_LIFELINE_FD"
INHERITED_PENDING_FD = "MME_BACKEND_PENDING_FD"
INHERITED_LOAD_STARTED = "MME_BACKEND_LOAD_STARTED"


@dataclass(frozen=True)
class EnvVar:
    """One documented variable: the README table is generated from ``ENV_VARS``."""

    name: str
    default: str
    field: str
    description: str


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("SAGEMAKER_BIND_TO_PORT", "8080", "port", "Port of the inference and management API (below 32767)."),
    EnvVar(
        "SAGEMAKER_MULTI_MODEL",
        "true",
        "multi_model",
        "Multi-model mode: models arrive by LOAD. `false`: `/opt/ml/model` is loaded at start for `/invocations`.",
    ),
    EnvVar(
        "SAGEMAKER_MODEL_SERVER_WORKERS",
        "1 per GPU (1 on CPU)",
        "workers_per_model",
        "Workers per model (`default_workers_per_model`).",
    ),
    EnvVar(
        "SAGEMAKER_MODEL_SERVER_TIMEOUT",
        "60",
        "response_timeout_seconds",
        "Seconds a worker may take for one request, and for loading a model.",
    ),
    EnvVar(
        "SAGEMAKER_STARTUP_TIMEOUT",
        "600",
        "startup_timeout_seconds",
        "Seconds the entrypoint waits for MMS to answer `/ping` before it retries the start.",
    ),
    EnvVar(
        "SAGEMAKER_MAX_REQUEST_SIZE",
        "6291456 (6 MiB)",
        "max_request_bytes",
        "Largest request body in bytes (`max_request_size`); `SAGEMAKER_MAX_PAYLOAD_IN_MB` is accepted too.",
    ),
    EnvVar(
        "SAGEMAKER_CONTAINER_LOG_LEVEL",
        "INFO",
        "log_level",
        "Log level of the entrypoint and workers (a name or a number).",
    ),
    EnvVar("SAGEMAKER_PROGRAM", "inference.py", "program", "File name of the user script in the model's `code/`."),
    EnvVar(
        "SAGEMAKER_SUBMIT_DIRECTORY",
        "unset",
        "submit_directory",
        "Inference code for models without `code/`: a local directory or `s3://bucket/key.tar.gz`.",
    ),
    EnvVar(
        "SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT",
        "application/json",
        "default_accept",
        "Response type when a request has no `Accept` or `*/*`.",
    ),
    EnvVar(
        "MME_PRELOAD_MODEL_GPU",
        "from `mme-mms.properties` (`true`)",
        "preload_model_gpu",
        "Load each model once in a CUDA-free server and fork its workers; `false` loads in every worker.",
    ),
    EnvVar(
        "MME_METRICS_PORT",
        "9090",
        "metrics_port",
        "Port of the Prometheus `/metrics` endpoint the entrypoint serves; `0` turns metrics off.",
    ),
    EnvVar("MME_START_METHOD", "fork", "start_method", "How the backend server starts workers: `fork` or `spawn`."),
    EnvVar(
        "PYTORCH_NVML_BASED_CUDA_CHECK",
        "1",
        "nvml_cuda_check",
        "Passed to workers: makes `torch.cuda.is_available()` safe in the preload server before fork.",
    ),
    EnvVar(
        "OMP_WAIT_POLICY",
        "PASSIVE",
        "omp_wait_policy",
        "Passed to the model processes: idle OpenMP threads sleep instead of spinning, leaving the cores to other "
        "models, the frontend and request decoding.",
    ),
    EnvVar(
        "MME_RUNTIME_DIR",
        "/tmp/mme",
        "runtime_dir",
        "Writable directory for the effective MMS properties, the MMS home and logs.",
    ),
    EnvVar(
        "MME_CACHE_DIR",
        "/tmp/mme/cache",
        "cache_dir",
        "Local cache shared by all models: `code/` (S3 archives by URI and ETag), `requirements/` (by file hash), "
        "`compiled/` (AOTInductor packages of `compile=true` models, by content).",
    ),
    EnvVar(
        "MME_MEMORY_HEADROOM_MB",
        "256",
        "memory_headroom_mb",
        "Memory a LOAD must leave free beyond the model's artifacts (host, and its GPU), or it answers 507.",
    ),
    EnvVar(
        "MME_MODEL_CACHE_MB",
        "2048",
        "model_cache_mb",
        "Host memory the warm process may hold for loaded TorchScript models shared by servers (0: no cache).",
    ),
    EnvVar(
        "MME_BATCH_SIZE",
        "1 (off)",
        "batch_size",
        "Requests per forward pass for models whose `serving.properties` sets no `batch_size` (see Batching).",
    ),
    EnvVar(
        "MME_MAX_BATCH_DELAY_MS",
        "10",
        "max_batch_delay_ms",
        "Longest a batch waits for more requests after a forward pass, for models that set no `max_batch_delay`.",
    ),
    EnvVar(
        "MME_MAX_CONCURRENCY",
        "4 unbatched, 1 batching",
        "max_concurrency",
        "Forward passes of one model that may run at once on a device, for models that set no `max_concurrency`.",
    ),
    EnvVar(
        "MME_SHARE_DEVICE",
        "true",
        "share_device",
        "Serve every model that can share one in one device host per device (one CUDA context per GPU); `false` "
        "gives every model processes of its own, as `isolation=process` does for one model.",
    ),
    EnvVar(
        "MME_CPU_HOSTS",
        "2",
        "cpu_hosts",
        "Device hosts that serve the models on the CPU, each model on one (the one with the fewest models): each "
        "host has one Python interpreter lock, so two let Python-bound models run side by side.",
    ),
    EnvVar(
        "MME_S3_TIMEOUT_SECONDS",
        "30",
        "s3_timeout_seconds",
        "Read timeout of one S3 call for inference code (connect: at most 5 s; 2 attempts).",
    ),
    EnvVar(
        "MME_PIP_TIMEOUT_SECONDS",
        "300",
        "pip_timeout_seconds",
        "Longest a model's `requirements.txt` install may take before its LOAD fails.",
    ),
    EnvVar(
        "MME_PROPERTIES_FILE",
        "`<runtime dir>/mme-mms.properties`",
        "properties_file",
        "MME properties; seeded from the shipped `mme-mms.properties`, `preload_model_gpu=true` added once.",
    ),
    EnvVar(
        "MME_LOAD_MODELS",
        "unset",
        "load_models",
        "Models to load at start, `name=/path,name2=/path2` (used by `make serve` for its demo model).",
    ),
    EnvVar(
        "MME_MODEL_ROOT",
        "/opt/ml/models",
        "model_root",
        "LOAD accepts only model directories under this root (resolved: `..` and symlinks cannot leave it).",
    ),
    EnvVar(
        "MME_ALLOW_ANY_MODEL_LOCATION",
        "false",
        "allow_any_model_location",
        "Lets LOAD name any directory, and http(s) URLs MMS downloads; off in multi-model mode for safety.",
    ),
    EnvVar(
        "MME_START_ATTEMPTS",
        "3",
        "start_attempts",
        "How many times the entrypoint tries to start MMS before it gives up.",
    ),
    EnvVar(
        "MME_STOP_GRACE_SECONDS",
        "20",
        "stop_grace_seconds",
        "Seconds between SIGTERM and SIGKILL for MMS and its workers (SageMaker kills at 30 s).",
    ),
)


def markdown_table() -> str:
    """The README's configuration table, generated so that it cannot drift from the code."""
    lines = ["| Variable | Default | What it does |", "|---|---|---|"]
    lines += [f"| `{var.name}` | {var.default} | {var.description} |" for var in ENV_VARS]
    return "\n".join(lines)


def parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean (use true or false)")


def parse_int(name: str, value: str, minimum: int, maximum: int | None = None) -> int:
    try:
        number = int(value.strip())
    except ValueError as exc:
        raise ConfigError(f"{name}={value!r} is not an integer") from exc
    if number < minimum or (maximum is not None and number > maximum):
        upper = f" and at most {maximum}" if maximum is not None else ""
        raise ConfigError(f"{name}={value!r} must be at least {minimum}{upper}")
    return number


def _parse_log_level(name: str, value: str) -> int:
    text = value.strip()
    if text.isdigit():
        return int(text)
    level = logging.getLevelName(text.upper())
    if not isinstance(level, int):
        raise ConfigError(f"{name}={value!r} is not a log level (DEBUG, INFO, WARNING, ERROR or a number)")
    return level


def _parse_load_models(name: str, value: str) -> tuple[tuple[str, str], ...]:
    models = []
    for entry in filter(None, (part.strip() for part in value.split(","))):
        model_name, sep, path = entry.partition("=")
        if not sep or not model_name or not path:
            raise ConfigError(f"{name}: {entry!r} is not of the form name=/path/to/model")
        models.append((model_name, path))
    return tuple(models)


def _parse_start_method(name: str, value: str) -> StartMethod:
    if value == "fork":
        return "fork"
    if value == "spawn":
        return "spawn"
    raise ConfigError(f"{name}={value!r} must be fork or spawn")


def process_environment() -> dict[str, str]:
    """A copy of this process's environment, for handing on to a process that stands in for this one."""
    return dict(os.environ)


def read_properties(path: Path) -> dict[str, str]:
    """Reads a Java properties file the simple way MMS writes them: ``key=value`` lines, ``#`` comments."""
    properties: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "!")):
            continue
        key, sep, value = stripped.partition("=")
        if sep:
            properties[key.strip()] = value.strip()
    return properties


@dataclass(frozen=True)
class Config:
    """The effective configuration. Build it with ``Config.from_env``; tests pass a plain dict."""

    port: int = 8080
    multi_model: bool = True
    workers_per_model: int | None = None
    response_timeout_seconds: int = 60
    startup_timeout_seconds: int = 600
    max_request_bytes: int = 6 * MIB
    log_level: int = logging.INFO
    program: str = "inference.py"
    submit_directory: str | None = None
    default_accept: str = "application/json"
    preload_model_gpu: bool | None = None
    start_method: StartMethod = "fork"
    warm_start: bool = True
    runtime_dir: Path = Path("/tmp/mme")
    cache_dir: Path = Path("/tmp/mme/cache")
    s3_timeout_seconds: int = 30
    model_cache_mb: int = 2048
    memory_headroom_mb: int = 256
    batch_size: int = 1
    max_batch_delay_ms: int = 10
    max_concurrency: int | None = None
    share_device: bool = True
    cpu_hosts: int = 2
    pip_timeout_seconds: int = 300
    properties_file: Path | None = None
    load_models: tuple[tuple[str, str], ...] = ()
    model_root: Path = Path("/opt/ml/models")
    allow_any_model_location: bool = False
    start_attempts: int = 3
    stop_grace_seconds: int = 20
    java_home: str | None = None
    # Read, not set, by us: the GPUs this container may use; workers pick theirs among them.
    cuda_visible_devices: str | None = None
    # Internal: a backend server that re-executed itself passes its listening socket on.
    inherited_listen_fd: int | None = None
    inherited_lifeline_fd: int | None = None
    inherited_pending_fd: int | None = None
    inherited_load_started: float | None = None  # the LOAD's start (wall clock), kept across that re-execution
    # torch's is_available() must ask NVML, not the CUDA driver, or the preload server poisons its forks.
    nvml_cuda_check: str = "1"
    # GNU OpenMP spins its idle threads by default: measured here, that burned 40% of a batching executor's CPU time,
    # which the frontend and the other models on the host need. Read when torch loads, so it is set for the processes
    # that import it (the warm process, and backends started without it).
    omp_wait_policy: str = "PASSIVE"
    metrics_port: int = 9090

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Config:
        """Builds the configuration; raises ``ConfigError`` naming the variable and value that are wrong."""
        values: dict[str, object] = {}

        def take(name: str, field: str, parse: Callable[[str, str], object]) -> None:
            raw = env.get(name)
            if raw is not None and raw.strip() != "":
                values[field] = parse(name, raw)

        take("SAGEMAKER_BIND_TO_PORT", "port", lambda n, v: _parse_port(n, v))
        take("SAGEMAKER_MULTI_MODEL", "multi_model", parse_bool)
        take("SAGEMAKER_MODEL_SERVER_WORKERS", "workers_per_model", lambda n, v: parse_int(n, v, 1))
        take("SAGEMAKER_MODEL_SERVER_TIMEOUT", "response_timeout_seconds", lambda n, v: parse_int(n, v, 1))
        take("SAGEMAKER_STARTUP_TIMEOUT", "startup_timeout_seconds", lambda n, v: parse_int(n, v, 1))
        take("SAGEMAKER_MAX_PAYLOAD_IN_MB", "max_request_bytes", lambda n, v: parse_int(n, v, 1) * MIB)
        take("SAGEMAKER_MAX_REQUEST_SIZE", "max_request_bytes", lambda n, v: parse_int(n, v, 1))
        take("SAGEMAKER_CONTAINER_LOG_LEVEL", "log_level", _parse_log_level)
        take("SAGEMAKER_PROGRAM", "program", lambda n, v: v.strip())
        take("SAGEMAKER_SUBMIT_DIRECTORY", "submit_directory", lambda n, v: v.strip())
        take("MME_CACHE_DIR", "cache_dir", lambda n, v: Path(v).absolute())
        take("MME_MEMORY_HEADROOM_MB", "memory_headroom_mb", lambda n, v: parse_int(n, v, 0))
        take("MME_MODEL_CACHE_MB", "model_cache_mb", lambda n, v: parse_int(n, v, 0))
        take("MME_BATCH_SIZE", "batch_size", lambda n, v: parse_int(n, v, 1, MAX_BATCH_SIZE))
        take("MME_MAX_BATCH_DELAY_MS", "max_batch_delay_ms", lambda n, v: parse_int(n, v, 0, MAX_BATCH_DELAY_MS))
        take("MME_MAX_CONCURRENCY", "max_concurrency", lambda n, v: parse_int(n, v, 1, MAX_CONCURRENCY))
        take("MME_SHARE_DEVICE", "share_device", parse_bool)
        take("MME_CPU_HOSTS", "cpu_hosts", lambda n, v: parse_int(n, v, 1, 64))
        take("MME_S3_TIMEOUT_SECONDS", "s3_timeout_seconds", lambda n, v: parse_int(n, v, 1))
        take("MME_PIP_TIMEOUT_SECONDS", "pip_timeout_seconds", lambda n, v: parse_int(n, v, 1))
        take("SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT", "default_accept", lambda n, v: v.strip())
        take("MME_PRELOAD_MODEL_GPU", "preload_model_gpu", parse_bool)
        take("MME_METRICS_PORT", "metrics_port", lambda n, v: parse_int(n, v, 0, 65535))
        take("MME_START_METHOD", "start_method", _parse_start_method)
        take("MME_WARM_START", "warm_start", parse_bool)
        take("MME_RUNTIME_DIR", "runtime_dir", lambda n, v: Path(v).absolute())
        take("MME_PROPERTIES_FILE", "properties_file", lambda n, v: Path(v).absolute())
        take("MME_LOAD_MODELS", "load_models", _parse_load_models)
        take("MME_MODEL_ROOT", "model_root", lambda n, v: Path(v).absolute())
        take("MME_ALLOW_ANY_MODEL_LOCATION", "allow_any_model_location", parse_bool)
        take("MME_START_ATTEMPTS", "start_attempts", lambda n, v: parse_int(n, v, 1))
        take("MME_STOP_GRACE_SECONDS", "stop_grace_seconds", lambda n, v: parse_int(n, v, 1, 28))
        take("JAVA_HOME", "java_home", lambda n, v: v.strip())
        take("CUDA_VISIBLE_DEVICES", "cuda_visible_devices", lambda n, v: v.strip())
        take("PYTORCH_NVML_BASED_CUDA_CHECK", "nvml_cuda_check", lambda n, v: v.strip())
        take("OMP_WAIT_POLICY", "omp_wait_policy", lambda n, v: v.strip())
        take(INHERITED_LISTEN_FD, "inherited_listen_fd", lambda n, v: parse_int(n, v, 0))
        take(INHERITED_LIFELINE_FD, "inherited_lifeline_fd", lambda n, v: parse_int(n, v, 0))
        take(INHERITED_PENDING_FD, "inherited_pending_fd", lambda n, v: parse_int(n, v, 0))
        take(INHERITED_LOAD_STARTED, "inherited_load_started", _parse_seconds)
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_process_env(cls) -> Config:
        """The configuration of this process: what entrypoints call."""
        return cls.from_env(os.environ)

    def child_environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment plus the variables that carry this configuration to MMS's backends."""
        return {**os.environ, **self.to_env(), **(extra or {})}

    @property
    def warm_socket(self) -> Path:
        return self.runtime_dir / "warm.sock"

    @property
    def metrics_dir(self) -> Path:
        """Where the model processes keep their Prometheus values for the entrypoint to expose."""
        return self.runtime_dir / "metrics"

    @property
    def effective_properties_file(self) -> Path:
        return self.properties_file or self.runtime_dir / "mme-mms.properties"

    def with_properties(self, properties: Mapping[str, str]) -> Config:
        """Fills settings the environment left open from the MME properties file (environment wins)."""
        if self.preload_model_gpu is not None:
            return self
        raw = properties.get("preload_model_gpu", "true")
        return dataclasses.replace(self, preload_model_gpu=parse_bool("preload_model_gpu (properties)", raw))

    def to_env(self) -> dict[str, str]:
        """The variables that carry this configuration to the backend processes MMS starts."""
        env = {
            "SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT": self.default_accept,
            "SAGEMAKER_PROGRAM": self.program,
            "SAGEMAKER_CONTAINER_LOG_LEVEL": str(self.log_level),
            "MME_START_METHOD": self.start_method,
            "MME_WARM_START": "true" if self.warm_start else "false",
            "MME_RUNTIME_DIR": str(self.runtime_dir),
            "MME_CACHE_DIR": str(self.cache_dir),
            "MME_MODEL_ROOT": str(self.model_root),
            "MME_ALLOW_ANY_MODEL_LOCATION": "true" if self.allow_any_model_location else "false",
            "MME_S3_TIMEOUT_SECONDS": str(self.s3_timeout_seconds),
            "MME_MEMORY_HEADROOM_MB": str(self.memory_headroom_mb),
            "MME_MODEL_CACHE_MB": str(self.model_cache_mb),
            "MME_BATCH_SIZE": str(self.batch_size),
            "MME_MAX_BATCH_DELAY_MS": str(self.max_batch_delay_ms),
            "MME_PIP_TIMEOUT_SECONDS": str(self.pip_timeout_seconds),
            "PYTORCH_NVML_BASED_CUDA_CHECK": self.nvml_cuda_check,
            "OMP_WAIT_POLICY": self.omp_wait_policy,
            "MME_METRICS_PORT": str(self.metrics_port),
            "MME_SHARE_DEVICE": "true" if self.share_device else "false",
            "MME_CPU_HOSTS": str(self.cpu_hosts),
        }
        if self.max_concurrency is not None:
            env["MME_MAX_CONCURRENCY"] = str(self.max_concurrency)
        if self.submit_directory is not None:
            env["SAGEMAKER_SUBMIT_DIRECTORY"] = self.submit_directory
        if self.preload_model_gpu is not None:
            env["MME_PRELOAD_MODEL_GPU"] = "true" if self.preload_model_gpu else "false"
        return env

    def describe(self) -> str:
        """One log line with every effective setting."""
        parts = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "log_level":
                value = logging.getLevelName(value)
            parts.append(f"{field.name}={value}")
        return " ".join(parts)


def _parse_seconds(name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError as exc:
        raise ConfigError(f"{name}={value!r} is not a number of seconds") from exc


def _parse_port(name: str, value: str) -> int:
    try:
        return parse_int(name, value, 1, MAX_MMS_PORT)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (MMS 1.1.11 cannot listen on port 32767 or above)") from exc

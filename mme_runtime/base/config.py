"""Every setting the container reads, in one frozen object built from an environment mapping
(``settings.py`` lists the variables, ``parsing.py`` turns their text into values).

This is the only module that reads ``os.environ``; everything else receives a ``Config``. It never
imports torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from mme_runtime.base.errors import ConfigError
from mme_runtime.base.failures import cgroup_memory
from mme_runtime.base.parsing import MIB, parse_bool
from mme_runtime.base.settings import ENTRYPOINT_MALLOC, RETIRED, SETTINGS

# the most kept packages may hold by default, and their share of the container's memory:
KEEP_UNLOADED_MB = 2048
KEEP_UNLOADED_SHARE = 16

SAGEMAKER_CLOUDWATCH_SECONDS = 60
# MMS 1.1.11's max_response_size where none is set
MMS_MAX_RESPONSE_BYTES = 6553500
# the entrypoint's own PYTHONMALLOC, where the user set none: glibc's malloc
ENTRYPOINT_ALLOCATOR = "malloc"


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
    hf_task: str | None = None
    max_new_tokens: int = 1024
    kv_cache_mb: int = 0  # 0: half the device's free memory when a generative model is placed
    submit_directory: str | None = None
    default_accept: str = "application/json"
    runtime_dir: Path = Path("/tmp/mme")
    cache_dir: Path = Path("/tmp/mme/cache")
    s3_timeout_seconds: int = 30
    model_cache_mb: int = 2048
    # from the environment: default_keep_unloaded_mb() unless set
    keep_unloaded_mb: int = KEEP_UNLOADED_MB
    memory_headroom_mb: int = 256
    batch_size: int = 1
    max_batch_delay_ms: int = 10
    batch_connections_at_load: int = 2
    max_concurrency: int | None = None
    share_device: bool = True
    share_weights: bool = True
    cpu_hosts: int = 2
    empty_host_seconds: int = 5
    recycle_peak_models: int = 64
    gpu_pass_threads: int = 4
    pip_timeout_seconds: int = 300
    properties_file: Path | None = None
    load_models: tuple[tuple[str, str], ...] = ()
    model_root: Path = Path("/opt/ml/models")
    allow_any_model_location: bool = False
    start_attempts: int = 3
    stop_grace_seconds: int = 20
    java_home: str | None = None
    # the frontend's JVM arguments; None: the properties file's, else DEFAULT_VMARGS
    vmargs: str | None = None
    # Read, not set, by us: the GPUs this container may use; workers pick theirs among them.
    cuda_visible_devices: str | None = None
    # Python's allocator where the user chose one (for every process), and whether the entrypoint
    # chose glibc's for itself alone (``entrypoint_environment``)
    python_malloc: str | None = None
    entrypoint_malloc: bool = False
    # torch's is_available() must ask NVML, not the CUDA driver, or a process that asks poisons its
    # forks.
    nvml_cuda_check: str = "1"
    # GNU OpenMP spins its idle threads by default: measured here, that burned 40% of a batching
    # model's process's CPU time, which the frontend and the other models on the host need. Read
    # when torch loads, so it is set for the processes that import it (the warm process, and through
    # it every model process).
    omp_wait_policy: str = "PASSIVE"
    # ... but not at once: a forward pass is hundreds of ops a few microseconds apart, and waking a
    # sleeping thread for each cost a lone generation 30% of its time here (GPT-2, 56 tokens: 248 ms
    # against 158). A short spin bridges those gaps and still sleeps between passes.
    gomp_spincount: str = "10000"
    # MKL keeps the buffers of its matrix products for each thread that ran one; a device host's
    # models each run theirs on threads of their own, so that was about 1 MiB per model. Freed after
    # each call instead: no slower on a BERT's passes here (1 and 16 rows).
    mkl_disable_fast_mm: str = "1"
    # glibc gives a thread that allocates while the arenas are busy an arena of its own, up to 8 per
    # core, and each keeps what its threads freed. A device host runs threads for each model: about
    # 0.7 MiB per model went to them. Two arenas: no slower here with 16 clients over 8 models,
    # batched and not.
    malloc_arena_max: str = "2"
    metrics_port: int = 9090
    # 0 (off) unless set; ``from_env`` makes it 60 where SAGEMAKER_MULTI_MODEL is set: on SageMaker,
    # nothing scrapes.
    cloudwatch_metrics_seconds: int = 0
    cloudwatch_namespace: str = "mme-gpu"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Config:
        """Builds the configuration; raises ``ConfigError`` naming the variable and value that are
        wrong."""
        values: dict[str, object] = {}
        for name, replacement in RETIRED.items():
            if value := env.get(name, "").strip():
                where = "docs/configuration.md#retired-settings"
                raise ConfigError(f"{name}={value} is no longer read: {replacement} ({where})")
        for setting in SETTINGS:
            raw = env.get(setting.name)
            if raw is not None and raw.strip() != "":
                values[setting.field] = setting.parse(setting.name, raw)
        if env.get("SAGEMAKER_MULTI_MODEL", "").strip():
            values.setdefault("cloudwatch_metrics_seconds", SAGEMAKER_CLOUDWATCH_SECONDS)
        values.setdefault("keep_unloaded_mb", default_keep_unloaded_mb())
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_process_env(cls) -> Config:
        """The configuration of this process: what entrypoints call."""
        return cls.from_env(os.environ)

    def child_environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment plus the variables that carry this configuration to MMS's
        backends; without the allocator the entrypoint chose for itself."""
        env = {**os.environ, **self.to_env(), **(extra or {})}
        if self.entrypoint_malloc:
            env.pop(ENTRYPOINT_MALLOC, None)
            if self.python_malloc == ENTRYPOINT_ALLOCATOR:
                env.pop("PYTHONMALLOC", None)
        return env

    def entrypoint_environment(self) -> dict[str, str] | None:
        """The environment the entrypoint executes itself again with, once, before it serves; None
        when it runs so already, or the user chose ``PYTHONMALLOC``.

        Its scrapes' heap goes back after each on glibc's allocator, not on Python's
        (``metrics_exporter.release_heap`` says why); the model processes keep Python's."""
        if self.python_malloc is not None:
            return None
        return {**os.environ, "PYTHONMALLOC": ENTRYPOINT_ALLOCATOR, ENTRYPOINT_MALLOC: "true"}

    @property
    def max_response_bytes(self) -> int:
        """The frontend's limit on an answer's body (``max_response_size``): MMS's default, or the
        request limit where that is larger. MMS takes a larger answer for a corrupt one."""
        return max(self.max_request_bytes, MMS_MAX_RESPONSE_BYTES)

    @property
    def warm_socket(self) -> Path:
        return self.runtime_dir / "warm.sock"

    @property
    def models_socket(self) -> Path:
        """Where the frontend's connections for every model arrive (each model's socket path links
        here)."""
        return self.runtime_dir / "models.sock"

    @property
    def metrics_dir(self) -> Path:
        """Where the model processes keep their Prometheus values for the entrypoint to expose."""
        return self.runtime_dir / "metrics"

    @property
    def effective_properties_file(self) -> Path:
        return self.properties_file or self.runtime_dir / "mme-mms.properties"

    def with_properties(self, properties: Mapping[str, str]) -> Config:
        """Checks the MME properties file: its ``preload_model_gpu`` (written ``true`` once at
        start) must not say ``false``, which asked earlier designs to load each model in every
        worker."""
        if not parse_bool(
            "preload_model_gpu (properties)", properties.get("preload_model_gpu", "true")
        ):
            raise ConfigError(
                f"preload_model_gpu=false in {self.effective_properties_file} is no longer read: "
                f"{RETIRED['MME_PRELOAD_MODEL_GPU']} (docs/configuration.md#retired-settings)"
            )
        return self

    def to_env(self) -> dict[str, str]:
        """The variables that carry this configuration to the backend processes MMS starts."""
        env = {
            "SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT": self.default_accept,
            "SAGEMAKER_PROGRAM": self.program,
            "SAGEMAKER_CONTAINER_LOG_LEVEL": str(self.log_level),
            "MME_RUNTIME_DIR": str(self.runtime_dir),
            "MME_CACHE_DIR": str(self.cache_dir),
            "MME_MODEL_ROOT": str(self.model_root),
            "MME_ALLOW_ANY_MODEL_LOCATION": "true" if self.allow_any_model_location else "false",
            "MME_S3_TIMEOUT_SECONDS": str(self.s3_timeout_seconds),
            "MME_MEMORY_HEADROOM_MB": str(self.memory_headroom_mb),
            "MME_MODEL_CACHE_MB": str(self.model_cache_mb),
            "MME_BATCH_SIZE": str(self.batch_size),
            "MME_MAX_BATCH_DELAY_MS": str(self.max_batch_delay_ms),
            "MME_BATCH_CONNECTIONS_AT_LOAD": str(self.batch_connections_at_load),
            "MME_PIP_TIMEOUT_SECONDS": str(self.pip_timeout_seconds),
            "PYTORCH_NVML_BASED_CUDA_CHECK": self.nvml_cuda_check,
            "OMP_WAIT_POLICY": self.omp_wait_policy,
            "GOMP_SPINCOUNT": self.gomp_spincount,
            "MKL_DISABLE_FAST_MM": self.mkl_disable_fast_mm,
            "MALLOC_ARENA_MAX": self.malloc_arena_max,
            "MME_METRICS_PORT": str(self.metrics_port),
            "MME_SHARE_DEVICE": "true" if self.share_device else "false",
            "MME_SHARE_WEIGHTS": "true" if self.share_weights else "false",
            "MME_CPU_HOSTS": str(self.cpu_hosts),
            "MME_EMPTY_HOST_SECONDS": str(self.empty_host_seconds),
            "MME_RECYCLE_PEAK_MODELS": str(self.recycle_peak_models),
            "MME_GPU_PASS_THREADS": str(self.gpu_pass_threads),
            "MME_MAX_NEW_TOKENS": str(self.max_new_tokens),
            "MME_KV_CACHE_MB": str(self.kv_cache_mb),
        }
        if self.max_concurrency is not None:
            env["MME_MAX_CONCURRENCY"] = str(self.max_concurrency)
        if self.hf_task is not None:
            env["HF_TASK"] = self.hf_task
        if self.submit_directory is not None:
            env["SAGEMAKER_SUBMIT_DIRECTORY"] = self.submit_directory
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


def default_keep_unloaded_mb() -> int:
    """``MME_KEEP_UNLOADED_MB``'s default: 2048, or a sixteenth of the container's memory (its
    cgroup's limit, else the machine's) where that is less. Kept packages are memory SageMaker
    counts as used when it decides to unload models: 2 GiB was half of a 4 GiB instance."""
    limited = cgroup_memory()
    total = limited[1] if limited is not None else psutil.virtual_memory().total
    return min(KEEP_UNLOADED_MB, total // MIB // KEEP_UNLOADED_SHARE)

"""Every environment variable the container reads, grouped by what it configures: its field of
``Config``, its parser, and for the documented ones the default and description; and
``docs/configuration.md``, generated from them so that it cannot drift from the code (a test
compares the page with ``configuration_page()``). Regenerate it with::

    .venv/bin/python -m mme_runtime.base.settings > docs/configuration.md

Reading the environment is ``config.py``'s job; this module only describes it. Never imports torch.
"""

from __future__ import annotations

from mme_runtime.base.parsing import (
    MAX_BATCH_DELAY_MS,
    MAX_BATCH_SIZE,
    MAX_CONCURRENCY,
    MAX_NEW_TOKENS,
    Setting,
    integer,
    megabytes,
    namespace,
    parse_bool,
    parse_load_models,
    parse_log_level,
    parse_port,
    path,
    text,
)

ENTRYPOINT_MALLOC = "MME_ENTRYPOINT_MALLOC"

MODELS: tuple[Setting, ...] = (
    Setting(
        "HF_TASK",
        "hf_task",
        text,
        "unset",
        "Task of no-code Hugging Face models whose serving.properties has none.",
    ),
    Setting(
        "MME_MAX_NEW_TOKENS",
        "max_new_tokens",
        integer(1, MAX_NEW_TOKENS),
        "1024",
        "Most new tokens a request may ask of a no-code generative Hugging Face model (400 over "
        "it), for models whose serving.properties sets no `max_new_tokens`.",
    ),
    Setting(
        "MME_KV_CACHE_MB",
        "kv_cache_mb",
        integer(0),
        "0: half the device's free memory when the model is placed",
        "KV cache memory of one generative base's decoding batch (its rows and their padding), "
        "for models whose serving.properties sets no `kv_cache_mb`: rows that do not fit wait.",
    ),
    Setting(
        "MME_MODEL_ROOT",
        "model_root",
        path,
        "/opt/ml/models",
        "LOAD accepts only model directories under this root (resolved: `..` and symlinks cannot "
        "leave it).",
    ),
    Setting(
        "MME_ALLOW_ANY_MODEL_LOCATION",
        "allow_any_model_location",
        parse_bool,
        "false",
        "Lets LOAD name any directory, and http(s) URLs MMS downloads; off in multi-model mode for "
        "safety.",
    ),
    Setting(
        "MME_LOAD_MODELS",
        "load_models",
        parse_load_models,
        "unset",
        "Models to load at start, `name=/path,name2=/path2` (used by `make serve` for its demo "
        "model).",
    ),
    Setting(
        "MME_CACHE_DIR",
        "cache_dir",
        path,
        "/tmp/mme/cache",
        "Local cache shared by all models: `code/` (S3 archives by URI and ETag), `requirements/` "
        "(by file hash), `compiled/` (AOTInductor packages of `compile=true` models, by content).",
    ),
    Setting(
        "MME_MODEL_CACHE_MB",
        "model_cache_mb",
        integer(0),
        "2048",
        "`0` runs a loader for every name that names the same artifacts (a package each); any "
        "other value lets the names share one package (its size is bounded by the models that use "
        "it, not by this number).",
    ),
    Setting(
        "MME_KEEP_UNLOADED_MB",
        "keep_unloaded_mb",
        integer(0),
        "2048, or 1/16 of the container's memory where that is less",
        "Host memory the packages of unloaded models may keep, least recently used out first and "
        "never while a LOAD needs it: a re-LOAD of the same files then skips `model_fn` (0: none "
        "kept).",
    ),
    Setting(
        "MME_MEMORY_HEADROOM_MB",
        "memory_headroom_mb",
        integer(0),
        "256",
        "Memory a LOAD must leave free beyond the model's artifacts (host, and its GPU), or it "
        "answers 507.",
    ),
    Setting(
        "MME_PIP_TIMEOUT_SECONDS",
        "pip_timeout_seconds",
        integer(1),
        "300",
        "Longest a model's `requirements.txt` install may take before its LOAD fails.",
    ),
    Setting(
        "MME_S3_TIMEOUT_SECONDS",
        "s3_timeout_seconds",
        integer(1),
        "30",
        "Read timeout of one S3 call for inference code (connect: at most 5 s; 2 attempts).",
    ),
)
BATCHING: tuple[Setting, ...] = (
    Setting(
        "MME_BATCH_SIZE",
        "batch_size",
        integer(1, MAX_BATCH_SIZE),
        "1 (off)",
        "Requests per forward pass for models whose `serving.properties` sets no `batch_size` (see "
        "Batching).",
    ),
    Setting(
        "MME_MAX_BATCH_DELAY_MS",
        "max_batch_delay_ms",
        integer(0, MAX_BATCH_DELAY_MS),
        "10",
        "Longest a batch waits for more requests after a forward pass, for models that set no "
        "`max_batch_delay`.",
    ),
    Setting(
        "MME_BATCH_CONNECTIONS_AT_LOAD",
        "batch_connections_at_load",
        integer(2, MAX_BATCH_SIZE),
        "2",
        "Frontend connections per device a batching model opens at LOAD; the rest of its "
        "`batch_size` open the first time all of them are busy at once (see Batching).",
    ),
    Setting(
        "MME_MAX_CONCURRENCY",
        "max_concurrency",
        integer(1, MAX_CONCURRENCY),
        "4 unbatched, 1 batching",
        "Forward passes of one model that may run at once on a device, for models that set no "
        "`max_concurrency`.",
    ),
)


# Settings of earlier designs that no longer mean anything, and what replaced each: the entrypoint
# refuses to start with one set (``Config.from_env``), rather than ignore what a user asked for.
RETIRED: dict[str, str] = {
    "MME_PRELOAD_MODEL_GPU": "every model is loaded once, CUDA-free, in a loader; a model_fn that "
    "needs CUDA runs in its device host by itself",
    "MME_START_METHOD": "every model process is forked from the warm process; isolation=process in "
    "a model's serving.properties gives it a device host of its own",
    "MME_WARM_START": "the warm process serves every model; isolation=process in a model's "
    "serving.properties gives it a device host of its own",
}

# When two variables set the same field, the later one in this order wins.
SAGEMAKER: tuple[Setting, ...] = (
    Setting(
        "SAGEMAKER_BIND_TO_PORT",
        "port",
        parse_port,
        "8080",
        "Port of the inference and management API (below 32767).",
    ),
    Setting(
        "SAGEMAKER_MULTI_MODEL",
        "multi_model",
        parse_bool,
        "true",
        "Multi-model mode: models arrive by LOAD. `false`: `/opt/ml/model` is loaded at start for "
        "`/invocations`.",
    ),
    Setting(
        "SAGEMAKER_MODEL_SERVER_WORKERS",
        "workers_per_model",
        integer(1),
        "1 per GPU (1 on CPU)",
        "Workers per model (`default_workers_per_model`).",
    ),
    Setting(
        "SAGEMAKER_MODEL_SERVER_TIMEOUT",
        "response_timeout_seconds",
        integer(1),
        "60",
        "Seconds a request may take: a forward pass still running then answers 504. MMS waits at "
        "least 360 s for a LOAD (SageMaker's limit: docs/api.md, Long LOADs). "
        "`SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS` wins over it.",
    ),
    Setting("SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS", "response_timeout_seconds", integer(1)),
    Setting(
        "SAGEMAKER_STARTUP_TIMEOUT",
        "startup_timeout_seconds",
        integer(1),
        "600",
        "Seconds the entrypoint waits for MMS to answer `/ping` before it retries the start.",
    ),
    Setting("SAGEMAKER_MAX_PAYLOAD_IN_MB", "max_request_bytes", megabytes),
    Setting(
        "SAGEMAKER_MAX_REQUEST_SIZE",
        "max_request_bytes",
        integer(1),
        "6291456 (6 MiB)",
        "Largest request body in bytes (`max_request_size`); `SAGEMAKER_MAX_PAYLOAD_IN_MB` is "
        "accepted too. An answer's body may be this large, or 6553500 bytes (MMS's "
        "`max_response_size`) where that is larger; a larger one answers 500, naming the limit.",
    ),
    Setting(
        "SAGEMAKER_MODEL_SERVER_VMARGS",
        "vmargs",
        text,
        "`vmargs` of the MME properties file, else `-XX:+UseContainerSupport "
        "-XX:MaxRAMPercentage=10.0`",
        "Arguments of the frontend's JVM. The default caps its heap at a tenth of the container's "
        "memory (the JVM's own default is a quarter).",
    ),
    Setting(
        "SAGEMAKER_CONTAINER_LOG_LEVEL",
        "log_level",
        parse_log_level,
        "INFO",
        "Log level of the entrypoint and workers (a name or a number).",
    ),
    Setting(
        "SAGEMAKER_PROGRAM",
        "program",
        text,
        "inference.py",
        "File name of the user script in the model's `code/`.",
    ),
    Setting(
        "SAGEMAKER_SUBMIT_DIRECTORY",
        "submit_directory",
        text,
        "unset",
        "Inference code for models without `code/`: a local directory or `s3://bucket/key.tar.gz`.",
    ),
    Setting(
        "SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT",
        "default_accept",
        text,
        "application/json",
        "Response type when a request has no `Accept` or `*/*`.",
    ),
)
PROCESSES: tuple[Setting, ...] = (
    Setting(
        "MME_SHARE_DEVICE",
        "share_device",
        parse_bool,
        "true",
        "Serve every model that can share one in one device host per device (one CUDA context per "
        "GPU); `false` gives every model a device host of its own, as `isolation=process` does for "
        "one model.",
    ),
    Setting(
        "MME_SHARE_WEIGHTS",
        "share_weights",
        parse_bool,
        "true",
        "Hold a tensor equal to one another model holds once, in host memory and on each GPU "
        "(docs/sharing.md); `false` gives every model its own copy and skips hashing its tensors "
        "at LOAD.",
    ),
    Setting(
        "MME_CPU_HOSTS",
        "cpu_hosts",
        integer(1, 64),
        "2",
        "Device hosts that serve the models on the CPU, each model on one (the one with the fewest "
        "models): each host has one Python interpreter lock, so two let Python-bound models run "
        "side by side.",
    ),
    Setting(
        "MME_EMPTY_HOST_SECONDS",
        "empty_host_seconds",
        integer(0),
        "5",
        "Seconds a CPU host left with no model lives on before it ends, with the heap its "
        "models freed (the next model chosen for it starts another in milliseconds): a LOAD that "
        "follows an UNLOAD within this keeps its host. A GPU's host stays, with its CUDA context.",
    ),
    Setting(
        "MME_RECYCLE_PEAK_MODELS",
        "recycle_peak_models",
        integer(0),
        "64",
        "A CPU host that held at least this many models, once UNLOADs leave it a sixteenth of them "
        "or fewer, moves them to a fresh host and ends: the memory it kept from the models gone "
        "goes with it, and no request is lost (0: never).",
    ),
    Setting(
        "MME_GPU_PASS_THREADS",
        "gpu_pass_threads",
        integer(1, 64),
        "4",
        "Threads that run the forward passes of every model on one GPU, however many models it "
        "holds: each thread that runs CUDA ops keeps a cuBLAS handle and workspace on the card "
        "(about 100 MiB on an H100).",
    ),
    Setting(
        "MME_RUNTIME_DIR",
        "runtime_dir",
        path,
        "/tmp/mme",
        "Writable directory: MMS properties, home and logs.",
    ),
    Setting(
        "MME_PROPERTIES_FILE",
        "properties_file",
        path,
        "`<runtime dir>/mme-mms.properties`",
        "MME properties; seeded from the shipped `mme-mms.properties`, `preload_model_gpu=true` "
        "added once.",
    ),
    Setting(
        "MME_START_ATTEMPTS",
        "start_attempts",
        integer(1),
        "3",
        "Tries the entrypoint gives MMS to start.",
    ),
    Setting(
        "MME_STOP_GRACE_SECONDS",
        "stop_grace_seconds",
        integer(1, 28),
        "20",
        "Seconds between SIGTERM and SIGKILL for MMS and its workers (SageMaker kills at 30 s).",
    ),
    Setting(
        "PYTORCH_NVML_BASED_CUDA_CHECK",
        "nvml_cuda_check",
        text,
        "1",
        "Passed to workers: makes `torch.cuda.is_available()` safe in the processes we fork from.",
    ),
    Setting(
        "OMP_WAIT_POLICY",
        "omp_wait_policy",
        text,
        "PASSIVE",
        "Passed to the model processes: idle OpenMP threads sleep instead of spinning, leaving the "
        "cores to other models, the frontend and request decoding.",
    ),
    Setting(
        "GOMP_SPINCOUNT",
        "gomp_spincount",
        text,
        "10000",
        "Passed to the model processes: how long an idle OpenMP thread spins before it sleeps (GNU "
        "OpenMP, which torch's wheels use; about a tenth of a millisecond): enough to bridge the "
        "ops of one forward pass.",
    ),
    Setting(
        "MKL_DISABLE_FAST_MM",
        "mkl_disable_fast_mm",
        text,
        "1",
        "Passed to the model processes: MKL gives its matrix buffers back after each call instead "
        "of keeping them for each thread that ran one (about 1 MiB per model in a device host; no "
        "slower, measured on BERT).",
    ),
    Setting(
        "MALLOC_ARENA_MAX",
        "malloc_arena_max",
        text,
        "2",
        "Passed to MMS and the model processes: glibc's malloc arenas at most (its default is 8 "
        "per core, each keeping what its threads freed; in a device host that was about 0.7 MiB "
        "per model). Raise it if a profile shows threads waiting in malloc.",
    ),
)
METRICS: tuple[Setting, ...] = (
    Setting(
        "MME_METRICS_PORT",
        "metrics_port",
        integer(0, 65535),
        "9090",
        "Port of the Prometheus `/metrics` endpoint the entrypoint serves; `0` turns metrics off "
        "(CloudWatch's too).",
    ),
    Setting(
        "MME_CLOUDWATCH_METRICS_SECONDS",
        "cloudwatch_metrics_seconds",
        integer(0, 3600),
        "60 where `SAGEMAKER_MULTI_MODEL` is set, else 0",
        "Seconds between the per-model CloudWatch metrics the entrypoint prints to stdout "
        "([on SageMaker](metrics.md#cloudwatch-on-sagemaker)); `0` turns them off.",
    ),
    Setting(
        "MME_CLOUDWATCH_NAMESPACE",
        "cloudwatch_namespace",
        namespace,
        "mme-gpu",
        "Namespace of those metrics.",
    ),
)
INHERITED: tuple[Setting, ...] = (
    Setting("JAVA_HOME", "java_home", text),
    Setting("CUDA_VISIBLE_DEVICES", "cuda_visible_devices", text),
    Setting("PYTHONMALLOC", "python_malloc", text),
    # set by the entrypoint for itself (``Config.entrypoint_environment``), never by a user
    Setting(ENTRYPOINT_MALLOC, "entrypoint_malloc", parse_bool),
)

SECTIONS: tuple[tuple[str, tuple[Setting, ...]], ...] = (
    ("SageMaker's own variables", SAGEMAKER),
    ("Models, their code and their caches", MODELS),
    ("Batching and concurrency", BATCHING),
    ("Processes and devices", PROCESSES),
    ("Metrics", METRICS),
)
SETTINGS: tuple[Setting, ...] = (*SAGEMAKER, *MODELS, *BATCHING, *PROCESSES, *METRICS, *INHERITED)


INTRODUCTION = """\
# Configuration

Every variable the container reads, with its default. SageMaker's own variables come first; the
project's own start with `MME_`. The container logs its effective configuration once at start. A
model's own settings (`batch_size`, `max_batch_delay`, `max_concurrency`, `isolation`, `compile`) go
in its `serving.properties` (see [batching](batching.md)); where both are set, the model's file
wins.

This page is generated from `mme_runtime/base/settings.py`; edit the descriptions there.
"""


def markdown_table(settings: tuple[Setting, ...]) -> str:
    lines = ["| Variable | Default | What it does |", "|---|---|---|"]
    lines += [f"| `{s.name}` | {s.default} | {s.description} |" for s in settings if s.description]
    return "\n".join(lines)


RETIRED_INTRODUCTION = """\
## Retired settings

These chose between process designs that no longer exist: since every model is served by a device
host (one per device, or one of its own), the container refuses to start with one of them set,
naming what replaced it. So does `preload_model_gpu=false` in the MME properties file
(`MME_PROPERTIES_FILE`), which the entrypoint writes `true`.
"""


def retired_table() -> str:
    lines = ["| Variable | What replaced it |", "|---|---|"]
    lines += [
        f"| `{name}` | {replacement[0].upper()}{replacement[1:]}. |"
        for name, replacement in RETIRED.items()
    ]
    return "\n".join(lines)


def configuration_page() -> str:
    parts = [INTRODUCTION]
    for title, settings in SECTIONS:
        parts.append(f"## {title}\n\n{markdown_table(settings)}\n")
    parts.append(f"{RETIRED_INTRODUCTION}\n{retired_table()}\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(configuration_page(), end="")

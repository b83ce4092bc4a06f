"""The environment variables that set what a model gets when its own ``serving.properties`` says nothing: where
models and their code come from, what is cached, the cap on a generation, and how requests are batched. Part of the
list ``settings.py`` gathers; never imports torch.
"""

from __future__ import annotations

from mme_runtime.base.parsing import (
    MAX_BATCH_DELAY_MS,
    MAX_BATCH_SIZE,
    MAX_CONCURRENCY,
    MAX_NEW_TOKENS,
    Setting,
    integer,
    parse_bool,
    parse_load_models,
    path,
    text,
)

MODELS: tuple[Setting, ...] = (
    Setting(
        "HF_TASK", "hf_task", text, "unset", "Task of no-code Hugging Face models whose serving.properties has none."
    ),
    Setting(
        "MME_MAX_NEW_TOKENS",
        "max_new_tokens",
        integer(1, MAX_NEW_TOKENS),
        "1024",
        "Most new tokens a request may ask of a no-code generative Hugging Face model (400 over it), for models "
        "whose serving.properties sets no `max_new_tokens`.",
    ),
    Setting(
        "MME_MODEL_ROOT",
        "model_root",
        path,
        "/opt/ml/models",
        "LOAD accepts only model directories under this root (resolved: `..` and symlinks cannot leave it).",
    ),
    Setting(
        "MME_ALLOW_ANY_MODEL_LOCATION",
        "allow_any_model_location",
        parse_bool,
        "false",
        "Lets LOAD name any directory, and http(s) URLs MMS downloads; off in multi-model mode for safety.",
    ),
    Setting(
        "MME_LOAD_MODELS",
        "load_models",
        parse_load_models,
        "unset",
        "Models to load at start, `name=/path,name2=/path2` (used by `make serve` for its demo model).",
    ),
    Setting(
        "MME_CACHE_DIR",
        "cache_dir",
        path,
        "/tmp/mme/cache",
        "Local cache shared by all models: `code/` (S3 archives by URI and ETag), `requirements/` (by file hash), "
        "`compiled/` (AOTInductor packages of `compile=true` models, by content).",
    ),
    Setting(
        "MME_MODEL_CACHE_MB",
        "model_cache_mb",
        integer(0),
        "2048",
        "`0` runs a loader for every name that names the same artifacts (a package each); any other value lets the "
        "names share one package (its size is bounded by the models that use it, not by this number).",
    ),
    Setting(
        "MME_KEEP_UNLOADED_MB",
        "keep_unloaded_mb",
        integer(0),
        "2048, or 1/16 of the container's memory where that is less",
        "Host memory the packages of unloaded models may keep, least recently used out first and never while a LOAD "
        "needs it: a re-LOAD of the same files then skips `model_fn` (0: none kept).",
    ),
    Setting(
        "MME_MEMORY_HEADROOM_MB",
        "memory_headroom_mb",
        integer(0),
        "256",
        "Memory a LOAD must leave free beyond the model's artifacts (host, and its GPU), or it answers 507.",
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
        "Requests per forward pass for models whose `serving.properties` sets no `batch_size` (see Batching).",
    ),
    Setting(
        "MME_MAX_BATCH_DELAY_MS",
        "max_batch_delay_ms",
        integer(0, MAX_BATCH_DELAY_MS),
        "10",
        "Longest a batch waits for more requests after a forward pass, for models that set no `max_batch_delay`.",
    ),
    Setting(
        "MME_BATCH_CONNECTIONS_AT_LOAD",
        "batch_connections_at_load",
        integer(2, MAX_BATCH_SIZE),
        "2",
        "Frontend connections per device a batching model opens at LOAD; the rest of its `batch_size` open the first "
        "time all of them are busy at once (see Batching).",
    ),
    Setting(
        "MME_MAX_CONCURRENCY",
        "max_concurrency",
        integer(1, MAX_CONCURRENCY),
        "4 unbatched, 1 batching",
        "Forward passes of one model that may run at once on a device, for models that set no `max_concurrency`.",
    ),
)

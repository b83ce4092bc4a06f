"""A model's own serving settings: ``serving.properties`` in its directory, over the container-wide
defaults.

The keys are the ones MMS's LOAD and the AWS large-model container use: ``batch_size`` (requests per
forward pass) and ``max_batch_delay`` (milliseconds); ``max_concurrency`` (forward passes at once);
``isolation`` (``process``: never share the device host); ``compile`` (``true``) and
``compile_mode`` ask for an AOTInductor compile of the model on each device (``pt2.py``); ``task``,
``trust_remote_code`` and ``pooling`` for a Hugging Face model served with no code
(``huggingface/loading.py``); ``share_weights`` (``false``: its tensors are its own, never held once
with another model's, ``tensor_store.py``); ``base_model`` (a LoRA adapter's base, ``lora.py``);
``max_new_tokens``, ``max_generation_seconds`` and ``kv_cache_mb`` (a generative model's cap on new
tokens, on the time of one generation and on its decoding batch's KV cache,
``huggingface/generation.py``). A LOAD body that carries ``batch_size`` wins
over both: MMS then sends it in every worker's LOAD message. A malformed file fails the LOAD, with
the cause in the log.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ConfigError, ModelLoadError
from mme_runtime.base.parsing import (
    MAX_BATCH_DELAY_MS,
    MAX_BATCH_SIZE,
    MAX_CONCURRENCY,
    MAX_NEW_TOKENS,
    parse_bool,
    parse_int,
    parse_seconds,
)

logger = logging.getLogger(__name__)

FILE_NAME = "serving.properties"
KNOWN_KEYS = (
    *("batch_size", "max_batch_delay", "compile", "compile_mode", "max_concurrency", "isolation"),
    # A Hugging Face model served with no code (``huggingface/loading.py``): its task, and
    # whether its own code may run.
    *("task", "trust_remote_code", "pooling"),
    *("share_weights", "base_model"),
    *("max_new_tokens", "max_generation_seconds", "kv_cache_mb"),
)
COMPILE_MODES = ("default", "max-autotune")
ISOLATIONS = ("shared", "process")
POOLINGS = ("mean", "cls", "none")
# Forward passes of one model at once when nothing sets it: stock MMS runs one request per worker at
# once, so an unbatched model keeps that parallelism; a batching model runs one pass at a time,
# which is what lets a batch form.
DEFAULT_UNBATCHED_CONCURRENCY = 4


@dataclass(frozen=True)
class ServingSettings:
    """How one model is served: ``batch_size`` 1 means no batching; ``source`` says where the size
    came from."""

    batch_size: int
    max_batch_delay_ms: int
    source: str
    compile: bool = False
    compile_mode: str = "default"
    max_concurrency: int | None = None  # None: DEFAULT_UNBATCHED_CONCURRENCY unbatched, 1 batching
    isolation: str | None = (
        None  # "process": a host of its own; "shared": the shared host; None: the rules
    )
    task: str | None = None  # a Hugging Face model's task; None: HF_TASK, else its architecture's
    trust_remote_code: bool = False
    # feature-extraction: mean, cls or none; None: what the directory says
    pooling: str | None = None
    # tensors equal to another model's are held once (MME_SHARE_WEIGHTS can turn it off)
    share_weights: bool = True
    # a LoRA adapter's base: a directory under the model root, or relative to its own
    base_model: str | None = None
    max_new_tokens: int | None = None  # a generative model's cap; None: the container's
    # when a generation is cut; None: before the request's timeout
    max_generation_seconds: float | None = None
    kv_cache_mb: int | None = None  # a generative model's KV cache bound; None: the container's

    @property
    def batching(self) -> bool:
        return self.batch_size > 1

    @property
    def concurrency(self) -> int:
        """Forward passes of this model that may run at once on one device."""
        if self.max_concurrency is not None:
            return self.max_concurrency
        return 1 if self.batching else DEFAULT_UNBATCHED_CONCURRENCY

    def with_load_batch_size(self, batch_size: int) -> ServingSettings:
        """The LOAD body's ``batch_size`` (MMS passes it on; 1 when the body had none) wins over the
        file."""
        if batch_size <= 1:
            return self
        return replace(self, batch_size=min(batch_size, MAX_BATCH_SIZE), source="LOAD")


def read_settings(model_dir: Path, config: Config) -> ServingSettings:
    """The model's settings: its ``serving.properties`` where it has one, the container's defaults
    otherwise.

    Raises ``ModelLoadError`` naming the file, line and problem when the file is malformed.
    """
    defaults = ServingSettings(
        config.batch_size,
        config.max_batch_delay_ms,
        "MME_BATCH_SIZE",
        max_concurrency=config.max_concurrency,
    )
    path = model_dir / FILE_NAME
    if not path.is_file():
        return defaults
    try:
        values = _parse(path)
        size, delay = values.get("batch_size"), values.get("max_batch_delay")
        mode = values.get("compile_mode", "default")
        if mode not in COMPILE_MODES:
            raise ConfigError(f"compile_mode={mode!r} must be one of {', '.join(COMPILE_MODES)}")
        isolation = _choice("isolation", values.get("isolation"), ISOLATIONS)
        concurrency = values.get("max_concurrency")
        return ServingSettings(
            batch_size=defaults.batch_size
            if size is None
            else parse_int("batch_size", size, 1, MAX_BATCH_SIZE),
            max_batch_delay_ms=defaults.max_batch_delay_ms
            if delay is None
            else parse_int("max_batch_delay", delay, 0, MAX_BATCH_DELAY_MS),
            source=FILE_NAME if size is not None else defaults.source,
            compile=parse_bool("compile", values.get("compile", "false")),
            compile_mode=mode,
            max_concurrency=defaults.max_concurrency
            if concurrency is None
            else parse_int("max_concurrency", concurrency, 1, MAX_CONCURRENCY),
            isolation=isolation,
            task=values.get("task"),
            trust_remote_code=parse_bool(
                "trust_remote_code", values.get("trust_remote_code", "false")
            ),
            pooling=_choice("pooling", values.get("pooling"), POOLINGS),
            share_weights=parse_bool("share_weights", values.get("share_weights", "true")),
            base_model=values.get("base_model"),
            max_new_tokens=_optional_int(
                "max_new_tokens", values.get("max_new_tokens"), 1, MAX_NEW_TOKENS
            ),
            max_generation_seconds=_seconds(
                "max_generation_seconds", values.get("max_generation_seconds")
            ),
            kv_cache_mb=_optional_int("kv_cache_mb", values.get("kv_cache_mb"), 1, 1 << 30),
        )
    except (ConfigError, OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{FILE_NAME} is malformed: {exc}") from exc


def _optional_int(key: str, value: str | None, minimum: int, maximum: int) -> int | None:
    return None if value is None else parse_int(key, value, minimum, maximum)


def _seconds(key: str, value: str | None) -> float | None:
    if value is None:
        return None
    seconds = parse_seconds(key, value)
    if not seconds > 0:
        raise ConfigError(f"{key}={value!r} must be a positive number of seconds")
    return seconds


def _choice(key: str, value: str | None, choices: tuple[str, ...]) -> str | None:
    if value is not None and value not in choices:
        raise ConfigError(f"{key}={value!r} must be one of {', '.join(choices)}")
    return value


def _parse(path: Path) -> dict[str, str]:
    """``key=value`` lines (``#``/``!`` comments, blank lines); a line without ``=`` or a repeated
    key is an error. Keys this container does not use are logged and ignored, since files are often
    shared with other servers."""
    values: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "!")):
            continue
        key, sep, value = stripped.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ConfigError(f"line {number}: {stripped[:80]!r} is not key=value")
        if key in values:
            raise ConfigError(f"line {number}: {key} is set twice")
        if re.search(r"\s[#!]", value):
            # Java properties (and the AWS large-model container's files) have no trailing comments:
            # MMS would read the comment as part of the value, so it is refused rather than guessed
            # at.
            raise ConfigError(
                f"line {number}: {key}={value!r}: a comment must be on a line of its own"
            )
        if key not in KNOWN_KEYS:
            logger.warning(
                "%s line %d: %s is not a setting of this container; ignored", path, number, key
            )
            continue
        values[key] = value
    return values

"""Once per device host, before its first request: the model placed on its device, compiled for it
if asked, and the model's sample request.

``place_model`` moves a module there (or loads an artifact that only loads on its device);
``warmup_sample`` finds the request in the model's ``code/`` that the host answers at LOAD
(``dry_run``), and that ``compile=true`` traces the model with (``compiled``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from mme_runtime.base.config import Config
from mme_runtime.models.pt2 import compile_model
from mme_runtime.models.serving_properties import ServingSettings
from mme_runtime.serving import content
from mme_runtime.serving.content import StepError, load_failure
from mme_runtime.serving.contract import Contract, InferenceContext, RequestInFlight

logger = logging.getLogger(__name__)

# The model's contract on requests, payloads and content types (``ServedModel._answer``).
Answer = Callable[[list[RequestInFlight], list[Any], list[str | None]], None]

# An optional sample request in the model's code/, answered once per device host at LOAD (the dry
# run users enable).
WARMUP_SAMPLES = {"warmup.json": content.JSON, "warmup.csv": content.CSV, "warmup.npy": content.NPY}


@runtime_checkable
class PlacesItself(Protocol):
    """A model that goes to its device its own way: an AOTInductor package (``pt2.py``) is
    loaded there, a Hugging Face model (``mme_runtime.huggingface``) moves its module."""

    def place(self, device: torch.device) -> Any: ...


def place_model(model: Any, device: torch.device) -> Any:
    """Moves a module to ``device`` and switches it to eval mode, once per device host (not per
    request). An artifact that must be loaded on its device (an AOTInductor package) is loaded
    there."""
    if isinstance(model, PlacesItself):
        return model.place(device)
    if isinstance(model, torch.nn.Module):
        model = model.to(device)
        try:
            model.eval()
        except NotImplementedError:
            pass  # an exported program's module: it has no training mode to leave
    return model


def warmup_sample(code_dir: Path | None) -> tuple[str, Any, str] | None:
    """The model's sample request in its ``code/``: file name, payload and content type; None when
    it has none."""
    if code_dir is None:
        return None
    sample = next((name for name in WARMUP_SAMPLES if (code_dir / name).is_file()), None)
    if sample is None:
        return None
    raw = (code_dir / sample).read_bytes()
    content_type = WARMUP_SAMPLES[sample]
    return (
        sample,
        content.utf8_text(raw) if content_type in content.TEXT_TYPES else raw,
        content_type,
    )


def dry_run(
    code_dir: Path | None, context: InferenceContext, default_accept: str, answer: Answer
) -> None:
    """Answers the model's sample request (``code/warmup.json``, ``.csv`` or ``.npy``) once per
    device host, so TorchScript profiling and lazy initialisation are paid at LOAD, not by the
    first caller. ``answer`` runs the model's contract on requests (``ServedModel``'s)."""
    found = warmup_sample(code_dir)
    if found is None:
        return
    sample, payload, content_type = found
    started = time.monotonic()
    request = RequestInFlight(context, default_accept)
    answer([request], [payload], [content_type])
    if request.error is not None:
        # a sample the model cannot answer fails the LOAD, with the cause
        cause = request.error.cause if isinstance(request.error, StepError) else request.error
        raise load_failure(f"warm-up request code/{sample}", cause) from request.error
    logger.info(
        "model=%s warm-up request seconds=%.3f", context.model_name, time.monotonic() - started
    )


def compiled(
    model: Any,
    contract: Contract,
    context: InferenceContext,
    settings: ServingSettings,
    config: Config,
    code_dir: Path | None,
) -> Any:
    """``compile=true``: the model compiled for the context's device (traced on its decoded warm-up
    sample), or the model as it is (eager), with the reason logged."""
    found = warmup_sample(code_dir)
    if found is None:
        logger.warning(
            "model=%s compile=true: serving eager, not compiled: compiling needs a sample request "
            "in code/ (warmup.json, warmup.csv or warmup.npy) to trace the model with",
            context.model_name,
        )
        return model
    _, payload, content_type = found
    try:
        sample = contract.call("input_fn", context, payload, content_type)
    except Exception as exc:
        # boundary: the dry run after this reports a sample the model cannot take
        logger.warning(
            "model=%s compile=true: serving eager: input_fn refused the warm-up sample: %s",
            context.model_name,
            exc,
        )
        return model
    model_dir = Path(context.model_dir)
    return compile_model(
        model, context.model_name, model_dir, context.device, settings, sample, config.cache_dir
    )

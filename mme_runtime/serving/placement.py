"""Once per device host, before its first request: the model placed on its device, and the model's sample request.

``place_model`` moves a module there (or loads an artifact that only loads on its device); ``warmup_sample`` finds
the request in the model's ``code/`` that the host answers at LOAD (its dry run), and that ``compile=true``
traces the model with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from mme_runtime.serving import content

# An optional sample request in the model's code/, answered once per device host at LOAD (the dry run users enable).
WARMUP_SAMPLES = {"warmup.json": content.JSON, "warmup.csv": content.CSV, "warmup.npy": content.NPY}


@runtime_checkable
class PlacesItself(Protocol):
    """A model that goes to its device its own way: an AOTInductor package (``pt2.py``) is
    loaded there, a Hugging Face model (``mme_runtime.huggingface``) moves its module."""

    def place(self, device: torch.device) -> Any: ...


def place_model(model: Any, device: torch.device) -> Any:
    """Moves a module to ``device`` and switches it to eval mode, once per device host (not per request). An artifact
    that must be loaded on its device (an AOTInductor package) is loaded there."""
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
    """The model's sample request in its ``code/``: file name, payload and content type; None when it has none."""
    if code_dir is None:
        return None
    sample = next((name for name in WARMUP_SAMPLES if (code_dir / name).is_file()), None)
    if sample is None:
        return None
    raw = (code_dir / sample).read_bytes()
    content_type = WARMUP_SAMPLES[sample]
    return sample, content.utf8_text(raw) if content_type in content.TEXT_TYPES else raw, content_type

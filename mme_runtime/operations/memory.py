"""Memory honesty before a load: estimate what the model needs and refuse (507) what will not fit.

The estimate is the size of the model's artifacts (what a loaded PyTorch model roughly occupies), against the host's
available memory in the server and, in a worker bound to a GPU, that GPU's free memory as nvidia-smi reports it:
asking NVML through nvidia-smi keeps CUDA uninitialised. SageMaker answers a 507 by unloading other models and
retrying the LOAD.
"""

from __future__ import annotations

import logging
from pathlib import Path

import psutil

from mme_runtime.base.errors import InsufficientMemory
from mme_runtime.base.nvidia import gpu_free_bytes
from mme_runtime.base.parsing import MIB

logger = logging.getLogger(__name__)

SKIPPED_DIRECTORIES = frozenset({"code"})


def artifact_bytes(model_dir: Path) -> int:
    """Apparent size of the model's files, its code excepted (a sparse file counts at its full size)."""
    total = 0
    for path in model_dir.rglob("*"):
        if path.is_file() and not SKIPPED_DIRECTORIES.intersection(path.relative_to(model_dir).parts):
            total += path.stat().st_size
    return total


def check_host_memory(model_dir: Path, headroom_mb: int) -> None:
    """Raises InsufficientMemory when the artifacts plus headroom exceed the host's available memory."""
    needed = artifact_bytes(model_dir) + headroom_mb * MIB
    available = psutil.virtual_memory().available
    if needed > available:
        raise InsufficientMemory(
            f"{model_dir} needs about {needed // MIB} MiB of host memory, {available // MIB} MiB available"
        )


def check_context_memory(model_dir: Path, headroom_mb: int, model_bytes: int | None = None) -> bool:
    """In a process whose CUDA context exists (a device host): the artifacts plus headroom against what that context
    can still allocate, the card's free memory plus what torch's caching allocator holds unused. False when this
    process has no CUDA context (nothing checked: never create one for this). ``model_bytes``: what the model adds
    there when that is known to be less than its artifacts (tensors it shares with models already on the card)."""
    import torch

    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return False
    free, _ = torch.cuda.mem_get_info()
    free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    needed = (artifact_bytes(model_dir) if model_bytes is None else model_bytes) + headroom_mb * MIB
    if needed > free:
        raise InsufficientMemory(f"{model_dir} needs about {needed // MIB} MiB on the GPU, {free // MIB} MiB free")
    return True


def check_gpu_memory(model_dir: Path, gpu: str, headroom_mb: int) -> None:
    """Raises InsufficientMemory when the artifacts plus headroom exceed the free memory of ``gpu`` (an nvidia-smi
    index or UUID: the physical card)."""
    free = gpu_free_bytes(gpu)
    if free is None:
        return
    needed = artifact_bytes(model_dir) + headroom_mb * MIB
    if needed > free:
        raise InsufficientMemory(f"{model_dir} needs about {needed // MIB} MiB on GPU {gpu}, {free // MIB} MiB free")

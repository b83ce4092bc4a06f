"""Which device a worker uses, and the CUDA probe the CUDA-free backend server relies on.

``restrict_to_gpu`` runs in a worker right after fork and before any CUDA call, so that code saying ``cuda`` or
``cuda:0`` lands on the GPU the frontend assigned. ``cuda_initialized`` never initialises CUDA itself.
"""

from __future__ import annotations

import os

import torch

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def visible_gpu(gpu_id: int, visible_devices: str | None) -> str:
    """The physical GPU for the frontend's ``gpu_id``, within an existing ``CUDA_VISIBLE_DEVICES`` if any.

    MMS counts GPUs with nvidia-smi (which ignores ``CUDA_VISIBLE_DEVICES``) and hands out ids round-robin.
    """
    if visible_devices:
        allowed = [device.strip() for device in visible_devices.split(",") if device.strip()]
        if allowed:
            return allowed[gpu_id % len(allowed)]
    return str(gpu_id)


def restrict_to_gpu(gpu_id: int | None, visible_devices: str | None) -> None:
    """Makes only the assigned GPU visible to this process. Must run before its first CUDA call."""
    if gpu_id is None:
        return
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise RuntimeError("CUDA was initialised before the worker bound its GPU; the worker cannot be isolated")
    os.environ[CUDA_VISIBLE_DEVICES] = visible_gpu(gpu_id, visible_devices)


def worker_device(gpu_id: int | None) -> torch.device:
    """``cuda:0`` (the one GPU this worker sees) when it was assigned one and CUDA works; the CPU otherwise."""
    if gpu_id is None or not torch.cuda.is_available():
        return torch.device("cpu")
    # Our backend restricts each worker to one GPU; a stock MMS worker sees them all.
    return torch.device("cuda", 0 if torch.cuda.device_count() == 1 else gpu_id)


def cuda_initialized() -> bool:
    """Whether this process has a CUDA context. The preload server checks it before every fork."""
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]

"""Which device a device host uses, the CUDA probe the CUDA-free processes we fork from rely on, and
the CPU threads each process runs with.

``bind_gpu`` runs in a device host right after fork and before any CUDA call, so that code saying
``cuda`` or ``cuda:0`` lands on the GPU the frontend assigned. Nothing here initialises CUDA. The
processes we fork from (the warm process) run with one intra-op thread: a parallel CPU op leaves GNU
OpenMP's thread pool behind, and a forked child believes those threads exist and waits for them
forever at its own first parallel op. Each host sets torch's default back.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

import torch

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
# The frontend's assignment (an nvidia-smi index), kept beside MMS's "gpu_id", which a bound host
# rewrites to the CUDA ordinal that names the same card inside it (0): scripts written for the AWS
# containers build ``cuda:{gpu_id}`` from "gpu_id", and that must stay a valid device in a process
# that sees one GPU.
ASSIGNED_GPU_ID = "assigned_gpu_id"
# torch's own choice for a fresh process (OMP_NUM_THREADS or the CPUs it may use), read at import
# before anything here lowers it; forked children inherit it with the module.
DEFAULT_THREADS = torch.get_num_threads()


def single_threaded() -> None:
    """One intra-op thread in this process, so that it leaves no OpenMP pool for its forks to
    inherit."""
    torch.set_num_threads(1)


def set_threads(threads: int) -> None:
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def visible_gpu(gpu_id: int, visible_devices: str | None) -> str:
    """The physical GPU for the frontend's ``gpu_id``, within an existing ``CUDA_VISIBLE_DEVICES``
    if any.

    MMS counts GPUs with nvidia-smi (which ignores ``CUDA_VISIBLE_DEVICES``) and hands out ids
    round-robin.
    """
    if visible_devices:
        allowed = [device.strip() for device in visible_devices.split(",") if device.strip()]
        if allowed:
            return allowed[gpu_id % len(allowed)]
    return str(gpu_id)


def bind_gpu(gpu_id: int | None, visible_devices: str | None) -> int | None:
    """Makes only the assigned GPU visible to this process and returns the CUDA ordinal naming it
    here (0), or None without an assignment. Must run before this process's first CUDA call."""
    if gpu_id is None:
        return None
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise RuntimeError(
            "CUDA was initialised before the device host bound its GPU; it cannot be isolated"
        )
    os.environ[CUDA_VISIBLE_DEVICES] = visible_gpu(gpu_id, visible_devices)
    return 0


def record_gpu(
    properties: MutableMapping[str, Any], assigned: int | None, ordinal: int | None
) -> None:
    """Writes a device host's GPU into MMS's ``system_properties``: the CUDA ordinal as "gpu_id",
    the assignment beside."""
    properties["gpu_id"] = ordinal
    properties[ASSIGNED_GPU_ID] = assigned


def worker_device(cuda_ordinal: int | None) -> torch.device:
    """``cuda:<ordinal>`` when the host has a GPU and CUDA works; the CPU otherwise.

    Our hosts see one GPU, so the ordinal is 0; under stock MMS a worker sees them all and the
    ordinal is the frontend's id.
    """
    if cuda_ordinal is None or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", cuda_ordinal)


def cuda_initialized() -> bool:
    """Whether this process has a CUDA context. The warm process checks it before every fork."""
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]

"""What nvidia-smi says about the GPUs: how many, and how much memory is free. Never initialises
CUDA.

The MMS frontend counts GPUs the same way, so the ids it hands to workers are nvidia-smi indices.
"""

from __future__ import annotations

import logging
import shutil
import subprocess

from mme_runtime.base.parsing import MIB

logger = logging.getLogger(__name__)

TIMEOUT_SECONDS = 30


def _query(*arguments: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(
            ["nvidia-smi", *arguments], capture_output=True, text=True, timeout=TIMEOUT_SECONDS
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def gpu_count() -> int:
    """GPUs nvidia-smi lists; 0 where there is no driver."""
    listing = _query("-L") or ""
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def gpu_free_bytes(gpu: str) -> int | None:
    """Free memory of ``gpu`` (an nvidia-smi index or UUID), or None when nvidia-smi cannot tell."""
    output = _query(f"--id={gpu}", "--query-gpu=memory.free", "--format=csv,noheader,nounits")
    try:
        return int((output or "").strip().splitlines()[0]) * MIB
    except (ValueError, IndexError):
        logger.warning("cannot read free memory of GPU %s from nvidia-smi", gpu)
        return None

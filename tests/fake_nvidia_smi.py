"""A test double of ``nvidia-smi`` for CPU-only machines: it lists GPUs that do not exist.

Put first on the server's PATH, it makes the MMS frontend hand out GPU ids to workers (it counts GPUs with
``nvidia-smi --query-gpu=index --format=csv``) and our backend believe the host has GPUs, so the whole GPU
assignment path runs here: each worker binds ``CUDA_VISIBLE_DEVICES`` to its card and tells user code which one.
torch itself still finds no CUDA, so the model runs on the CPU. Every call is appended to ``calls.log``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

GPUS_VARIABLE = "FAKE_NVIDIA_SMI_GPUS"
LOG_VARIABLE = "FAKE_NVIDIA_SMI_LOG_DIR"
FREE_VARIABLE = "FAKE_NVIDIA_SMI_FREE_MIB"
FREE_MIB = 81920
# A file of ``pid, uuid, MiB`` lines: the processes the fake says hold GPU memory (none when unset).
APPS_VARIABLE = "FAKE_NVIDIA_SMI_APPS_FILE"


def install(directory: Path, gpus: int) -> dict[str, str]:
    """Writes an ``nvidia-smi`` into ``directory``; returns the environment that puts it first on the PATH."""
    directory.mkdir(parents=True, exist_ok=True)
    command = directory / "nvidia-smi"
    script = f'#!/bin/sh\n{LOG_VARIABLE}="{directory}" exec "{sys.executable}" "{Path(__file__).resolve()}" "$@"\n'
    command.write_text(script, encoding="utf-8")
    command.chmod(0o755)
    return {"PATH": f"{directory}{os.pathsep}{os.environ['PATH']}", GPUS_VARIABLE: str(gpus)}


def calls(directory: Path) -> list[str]:
    log = directory / "calls.log"
    return log.read_text(encoding="utf-8").splitlines() if log.exists() else []


def answer(arguments: list[str], gpus: int) -> str | None:
    """What the real nvidia-smi prints for the queries MMS and mme-gpu make; None for anything else."""
    if arguments == ["-L"]:
        return "".join(f"GPU {i}: NVIDIA Fake (UUID: GPU-fake-{i})\n" for i in range(gpus))
    if arguments == ["--query-gpu=index", "--format=csv"]:
        return "index\n" + "".join(f"{i}\n" for i in range(gpus))
    if len(arguments) == 3 and arguments[0].startswith("--id=") and arguments[1] == "--query-gpu=memory.free":
        gpu = arguments[0].removeprefix("--id=")
        free = os.environ.get(FREE_VARIABLE, str(FREE_MIB))
        return f"{free}\n" if gpu.isdigit() and int(gpu) < gpus else None
    if arguments == ["--query-gpu=index,uuid", "--format=csv,noheader"]:
        return "".join(f"{i}, GPU-fake-{i}\n" for i in range(gpus))
    if arguments and arguments[0].startswith("--query-compute-apps="):
        apps = Path(os.environ.get(APPS_VARIABLE, "/nonexistent"))
        return apps.read_text(encoding="utf-8") if apps.is_file() else ""
    return None


def main() -> int:
    with open(Path(os.environ[LOG_VARIABLE]) / "calls.log", "a", encoding="utf-8") as log:
        log.write(" ".join(sys.argv[1:]) + "\n")
    output = answer(sys.argv[1:], int(os.environ.get(GPUS_VARIABLE, "0")))
    if output is None:
        print(f"fake nvidia-smi: unsupported arguments {sys.argv[1:]}", file=sys.stderr)
        return 6
    sys.stdout.write(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

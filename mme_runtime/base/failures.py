"""Failures that explain themselves (issue #29): the words that open a failure's log line and, where
MMS carries it, its answer. One phrase per cause: ``out of host memory`` and ``out of GPU memory``
(with the numbers), ``import error``, ``<function> raised <Type>``, ``timed out after N s
(<SETTING>)``, and for a process that died ``killed by <SIGNAL>``, saying whether the kernel's
out-of-memory killer sent a SIGKILL. docs/troubleshooting.md lists them all.

Runs in every process. It never imports torch: it looks at torch only where it is imported already,
and reads GPU numbers only where this process's CUDA context exists (it never creates one).
"""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

import psutil

from mme_runtime.base.errors import first_line
from mme_runtime.base.parsing import MIB

MAX_DETAIL_CHARS = 300
# torch's CPU allocator raises a plain RuntimeError, so for it (and only it) the text is all there
# is to go by.
CPU_ALLOCATOR_FAILURE = "DefaultCPUAllocator: can't allocate memory"
# torch's CUDA message runs on for several sentences and a link; the numbers we add say the rest.
TORCH_OOM_HEAD = re.compile(r"^(.*?Tried to allocate [\d.]+ ?[KMGT]?i?B)")
MISSING_MODULE_HINT = (
    "add the package that provides it to code/requirements.txt, or the module to code/"
)
# Where the kernel counts its out-of-memory kills: the container's cgroup (v2, then v1), and the
# whole machine.
OOM_KILL_COUNTERS = (
    Path("/sys/fs/cgroup/memory.events"),
    Path("/sys/fs/cgroup/memory/memory.oom_control"),
    Path("/proc/vmstat"),
)
# The container's memory limit and use (cgroup v2, then v1); v1 reports "no limit" as a huge number.
CGROUP_MEMORY = (
    (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
    (
        Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
        Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ),
)
NO_CGROUP_LIMIT = 1 << 60


def is_out_of_memory(exc: BaseException) -> bool:
    """Host or device memory exhaustion, judged by type (never by the text "CUDA")."""
    if isinstance(exc, MemoryError) or is_gpu_out_of_memory(exc):
        return True
    return isinstance(exc, RuntimeError) and CPU_ALLOCATOR_FAILURE in str(exc)


def is_gpu_out_of_memory(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # an exception of torch's exists only where torch is imported
    return torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError)


def host_memory() -> str:
    """``host memory: X MiB available of Y MiB``, and the container's limit where its cgroup sets
    one."""
    memory = psutil.virtual_memory()
    text = f"host memory: {memory.available // MIB} MiB available of {memory.total // MIB} MiB"
    limit = cgroup_memory()
    if limit is not None:
        used, most = limit
        text += f"; container: {used // MIB} MiB used of its {most // MIB} MiB limit"
    return text


def cgroup_memory() -> tuple[int, int] | None:
    """(bytes used, limit) of this container's memory cgroup, or None where it has no limit."""
    for limit_path, used_path in CGROUP_MEMORY:
        try:
            limit_text, used = limit_path.read_text().strip(), int(used_path.read_text())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit() and int(limit_text) < NO_CGROUP_LIMIT:
            return used, int(limit_text)
        return None
    return None


def gpu_memory() -> str | None:
    """``GPU memory: X MiB free of Y MiB; this process: A MiB allocated, R MiB reserved``, where
    this process's CUDA context exists; None elsewhere."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        free, total = torch.cuda.mem_get_info()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    except Exception:  # noqa: BLE001
        # the numbers are a courtesy: a context the error left unusable has none
        return None
    return (
        f"GPU memory: {free // MIB} MiB free of {total // MIB} MiB; this process: "
        f"{allocated // MIB} MiB allocated, {reserved // MIB} MiB reserved"
    )


def out_of_memory(exc: BaseException, where: str | None = None) -> str:
    """``out of GPU memory in predict_fn: CUDA out of memory. Tried to allocate 2.00 GiB (GPU
    memory: ...)``, or ``out of host memory ...``, with the numbers as they are now (call it where
    the error is caught)."""
    gpu = is_gpu_out_of_memory(exc)
    numbers = gpu_memory() if gpu else host_memory()
    text = (
        f"out of {'GPU' if gpu else 'host'} memory{f' in {where}' if where else ''}: "
        f"{_oom_detail(exc)}"
    )
    return f"{text} ({numbers})" if numbers else text


def _oom_detail(exc: BaseException) -> str:
    text = first_line(exc)
    head = TORCH_OOM_HEAD.match(text)
    if head is not None:
        return head.group(1)
    if text == type(exc).__name__:
        return text
    return f"{type(exc).__name__}: {text}"[:MAX_DETAIL_CHARS]


def import_error(exc: ImportError, where: str) -> str:
    """``import error in code/inference.py: No module named 'foo' (add the package that provides it
    ...)``."""
    text = f"import error in {where}: {first_line(exc)[:MAX_DETAIL_CHARS]}"
    if isinstance(exc, ModuleNotFoundError):
        return f"{text} ({MISSING_MODULE_HINT})"
    return f"{text} (check the versions code/requirements.txt asks for)"


def raised(step: str, exc: BaseException) -> str:
    """``model_fn raised ValueError: its message``: a step of user code that failed, in words."""
    if is_out_of_memory(exc):
        return out_of_memory(exc, step)
    if isinstance(exc, ImportError):
        return import_error(exc, step)
    text = str(getattr(exc, "message", None) or first_line(exc))
    if text == type(exc).__name__:
        return f"{step} raised {text}"
    return f"{step} raised {type(exc).__name__}: {text[:MAX_DETAIL_CHARS]}"


def timed_out(seconds: float, setting: str, what: str) -> str:
    """``timed out after N s (SETTING): what``."""
    return f"timed out after {seconds:.0f} s ({setting}): {what}"


def oom_kills() -> dict[str, int]:
    """The kernel's counts of out-of-memory kills, by file, where they can be read (none on some
    kernels)."""
    counts = {}
    for path in OOM_KILL_COUNTERS:
        try:
            with open(path, "rb") as counters:  # as bytes: no text decoder made for each read
                lines = counters.read().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition(b" ")
            if key == b"oom_kill" and value.strip().isdigit():
                counts[str(path)] = int(value)
    return counts


def exit_cause(code: int, oom_kills_before: Mapping[str, int] | None = None) -> str:
    """How a child ended, from its exit code (negative: the signal): ``exited with status 3``,
    ``killed by SIGSEGV``, or for SIGKILL whether the kernel's out-of-memory killer sent it
    (``oom_kills_before``: ``oom_kills()`` when the child started), with the host's memory now."""
    if code >= 0:
        return f"exited with status {code}"
    name = signal_name(-code)
    if -code != signal.SIGKILL:
        return f"killed by {name}"
    return f"killed by {name} ({_sigkill_cause(oom_kills_before)})"


def oom_killed(code: int, oom_kills_before: Mapping[str, int]) -> bool:
    """Whether a child that ended with ``code`` was killed by the kernel's out-of-memory killer: a
    SIGKILL while its count rose (``oom_kills_before``: ``oom_kills()`` when the child started)."""
    return -code == signal.SIGKILL and bool(_oom_kills_risen(oom_kills_before))


def _oom_kills_risen(before: Mapping[str, int]) -> list[str]:
    return [
        f"oom_kill {before[path]} -> {n} in {path}"
        for path, n in oom_kills().items()
        if n > before.get(path, n)
    ]


def _sigkill_cause(before: Mapping[str, int] | None) -> str:
    now, before = oom_kills(), before or {}
    risen = _oom_kills_risen(before)
    if risen:
        return f"out of memory: the kernel's out-of-memory killer ran ({risen[0]}); {host_memory()}"
    if any(path in before for path in now):
        return "not by the kernel's out-of-memory killer, whose count did not change"
    return f"often the kernel's out-of-memory killer; {host_memory()}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return f"signal {number}"


class Deaths:
    """Children whose death by a signal deserves a line saying so: each one's label (``model=NAME
    loader pid=P``) and the kernel's out-of-memory kill count when it started. A SIGTERM is ours (an
    UNLOAD, a stop): not logged."""

    def __init__(self) -> None:
        self._children: dict[int, tuple[str, dict[str, int]]] = {}

    def watch(self, pid: int, label: str, oom_kills_before: dict[str, int] | None = None) -> None:
        """``oom_kills_before``: ``oom_kills()`` as the child started, if read already."""
        before = oom_kills() if oom_kills_before is None else oom_kills_before
        self._children[pid] = (label, before)

    def exited(self, pid: int, code: int) -> str | None:
        """``<label> killed by <SIGNAL> (...)`` for a watched child that a signal ended; None
        otherwise."""
        label, before = self._children.pop(pid, ("", {}))
        if not label or code >= 0 or -code == signal.SIGTERM:
            return None
        return f"{label} {exit_cause(code, before)}"

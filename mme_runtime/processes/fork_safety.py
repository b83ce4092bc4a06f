"""Whether children forked from a process that ran user code (``model_fn``) can still do their work.

Two things poison such forks, and neither shows in the parent:

* **CUDA.** torch refuses CUDA in a child whose parent initialised it, and also when the parent merely asked the
  CUDA runtime how many devices there are (``torch.cuda.device_count()`` where NVML fails), which leaves
  ``torch.cuda.is_initialized()`` false.
* **Thread pools.** A parallel CPU op (``load_state_dict`` copying a large tensor, a matmul, a warm-up pass) leaves
  GNU OpenMP's thread pool in the parent; a forked child believes those threads exist and waits for them forever at
  its own first parallel op. Processes we fork from therefore run with one intra-op thread, which creates no pool,
  and each worker sets its own count after fork. TorchScript's ``fork`` starts torch's inter-op pool (threads named
  ``PTThreadPool``), which a child waits on forever just the same; nothing prevents that one, so it is looked for.

``probe`` looks for the inter-op pool, then forks a child that checks CUDA and runs a parallel op and exits at once;
a child still running after ``PROBE_SECONDS`` hangs.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from mme_runtime.models.loading import die_with_parent

# torch's own choice for a fresh process (OMP_NUM_THREADS or the CPUs it may use), read at import before anything
# here lowers it; forked children inherit it with the module.
DEFAULT_THREADS = torch.get_num_threads()
PROBE_SECONDS = 5.0
# Above torch's grain size (32768 elements), so the op runs as an OpenMP parallel region when threads > 1.
PARALLEL_PROBE_ELEMENTS = 1 << 20
PROBE_THREADS = 2  # enough to need the pool; more would only cost thread creation
CUDA_REFUSED_EXIT = 3
INTEROP_THREAD_NAME = "PTThreadPool"  # what torch's c10 thread pools call their threads


def single_threaded() -> None:
    """One intra-op thread in this process, so that running user code creates no OpenMP pool its forks inherit."""
    torch.set_num_threads(1)


def threads_for_workers() -> int:
    """What workers forked from here run with: the count ``model_fn`` chose if it set one (other than the 1 set by
    ``single_threaded``), torch's default otherwise."""
    chosen = torch.get_num_threads()
    return chosen if chosen != 1 else DEFAULT_THREADS


def set_threads(threads: int) -> None:
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def probe(threads: int, check_cuda: bool) -> str | None:
    """Why a child forked now could not serve (with ``threads`` intra-op threads, and CUDA if ``check_cuda``), or
    None when it can. Free in a process with one thread and no CUDA to check (a server forked from the warm process
    starts with one thread); otherwise one fork, 5 to 25 ms."""
    names = _thread_names()
    if INTEROP_THREAD_NAME in names:
        return (
            "model_fn started torch's inter-op thread pool (torch.jit.fork in TorchScript), "
            "which forked workers would wait on forever"
        )
    # A lone thread means no pool exists to be lost in a fork; a worker with one thread never needs a pool.
    check_pools = len(names) > 1 and threads > 1
    if not (check_pools or check_cuda):
        return None
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's exit status is the answer
        die_with_parent(signal.SIGKILL)
        if check_cuda and _in_bad_fork():
            os._exit(CUDA_REFUSED_EXIT)
        if check_pools:
            set_threads(PROBE_THREADS)
            torch.ones(PARALLEL_PROBE_ELEMENTS).add_(1)
        os._exit(0)
    deadline = time.monotonic() + PROBE_SECONDS
    while True:
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return (
                "a forked child hung at its first parallel CPU op: model_fn left an OpenMP thread pool behind "
                "(did it call torch.set_num_threads?)"
            )
        time.sleep(0.005)
    code = os.waitstatus_to_exitcode(status)
    if code == CUDA_REFUSED_EXIT:
        return (
            "model_fn asked the CUDA runtime about devices in the preload server (torch.cuda.device_count() "
            "where NVML fails, say), so forked workers would be refused CUDA"
        )
    return None if code == 0 else f"a forked child failed its first parallel CPU op (exit status {code})"


def _in_bad_fork() -> bool:
    # A CPU-only torch has no CUDA to poison and answers False.
    return bool(torch.cuda._is_in_bad_fork())


def _thread_names() -> list[str]:
    """The names of this process's threads, one entry per thread."""
    names = []
    for thread in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{thread}/comm", encoding="utf-8") as comm:
                names.append(comm.read().strip())
        except OSError:
            continue  # the thread ended meanwhile
    return names

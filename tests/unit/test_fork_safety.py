"""The forked probe that tells the preload server whether its workers could serve: CUDA and parallel CPU ops.

Each test runs in a fresh interpreter: the OpenMP pool a parallel op leaves behind is process-wide and permanent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BIG_COPY = "torch.empty(1 << 22).copy_(torch.ones(1 << 22))  # as load_state_dict does with a large weight"


def run(body: str) -> str:
    """Runs ``body`` in a fresh interpreter, from a file (TorchScript needs the source); returns its output."""
    # os._exit at the end: torch's inter-op pool can abort the interpreter's own exit (its threads are torn down
    # while they still wait), which has nothing to do with what the case printed.
    header = "import os\nimport sys\nimport torch\nfrom mme_runtime.processes import fork_safety\n"
    source = header + textwrap.dedent(body)
    source += "\nsys.stdout.flush()\nos._exit(0)\n"
    with tempfile.TemporaryDirectory() as directory:
        script = Path(directory) / "probe_case.py"
        script.write_text(source, encoding="utf-8")
        result = subprocess.run(
            [sys.executable, str(script)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_fresh_process_forks_children_that_can_serve() -> None:
    assert run("print(fork_safety.probe(threads=2, check_cuda=True))") == "None"


def test_a_parallel_op_run_single_threaded_leaves_forks_usable() -> None:
    output = run(
        f"""
        fork_safety.single_threaded()
        {BIG_COPY}
        print(fork_safety.threads_for_workers() == fork_safety.DEFAULT_THREADS, fork_safety.probe(2, False))
        """
    )
    assert output == "True None"


def test_a_parallel_op_with_several_threads_is_caught_as_a_hang() -> None:
    output = run(
        f"""
        torch.set_num_threads(2)  # as a model_fn may
        {BIG_COPY}
        print(fork_safety.threads_for_workers(), fork_safety.probe(2, False))
        """
    )
    assert output.startswith("2 a forked child hung at its first parallel CPU op")


def test_torchscript_fork_in_the_parent_is_caught() -> None:
    output = run(
        """
        @torch.jit.script
        def ensemble(x: torch.Tensor) -> torch.Tensor:
            return torch.jit.wait(torch.jit.fork(torch.neg, x))

        ensemble(torch.ones(1))  # a warm-up pass of a model that runs branches in parallel
        print(fork_safety.probe(threads=1, check_cuda=False))
        """
    )
    assert output.startswith("model_fn started torch's inter-op thread pool")


def test_a_cuda_refusing_child_is_reported() -> None:
    # Test double of torch's bad-fork flag: true only in the forked child, as torch sets it.
    output = run(
        """
        parent = os.getpid()
        fork_safety._in_bad_fork = lambda: os.getpid() != parent
        print(fork_safety.probe(threads=1, check_cuda=True))
        """
    )
    assert "so forked workers would be refused CUDA" in output

"""The measurements: this server against its peers and itself, a benchmark per module, run by
``python -m benchmarks``.

``device_host``  many small models on one host: the device hosts against a process per model and the
                 stock stack
``stock``        our server (Prometheus metrics on and off) against the stock stack, same models,
                 one run
``batching``     dynamic batching against our unbatched server, the stock stack and TorchServe
``pt2``          PyTorch 2 artifacts (ExportedProgram, AOTInductor, compile=true) against
                 TorchScript
``preload``      preload on against off: LOAD time and memory of a model's processes, by devices and
                 workers
``sharing``      weights shared across models: fine-tunes of one base and LoRA adapters, sharing on
                 and off
``reload``       a re-LOAD after UNLOAD: the model's package kept in host memory against none kept
``handler``      one invoke through MMS's ``Service.predict`` around ours and the AWS handler, no
                 Java frontend
``gpu``          the README's GPU claims on a card, a part at a time (run by scripts/gpu-proof, only
                 when named)
``lora_generation``
                 LoRA adapters of one LLM decoding in one batch, against one adapter, batching off,
                 and the AWS Hugging Face stack serving each merged (run only when named)
``benchlib``     what they share: start a server on a free port, drive it, measure its process tree,
                 print a table
``peers``        the stacks we compare against, each installed into a virtual environment of its own

Each benchmark module has ``main(argv) -> int`` and its own options. A benchmark prints its results
on stdout (the Markdown tables ``python -m benchmarks --write-docs`` copies into docs/benchmarks.md)
and its progress on stderr. Benchmarks print tables and never assert timings: the machines here are
noisy, so compare ratios within one run. The tests check the correctness these numbers rest on.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The benchmarks build their models and pick their ports with the tests' helpers (model_factory,
# ports, serving, fake_nvidia_smi). tests/ is not a package, so it goes on the path here, before any
# benchmark module imports them.
_TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

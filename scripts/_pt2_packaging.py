"""PyTorch 2 artifacts for package_model.py: export an ``nn.Module`` factory to ``model.pt2``, and
compile a ``model.pt2`` ahead of time for a device (AOTInductor), so a SageMaker user ships a
compiled model.

torch is imported only when these options are used: packaging weights that are already saved does
not need it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from _aws_cli import config_error

PT2_FILE = "model.pt2"


def parse_example(text: str) -> tuple[int, ...]:
    """``"4,3,224,224"`` -> the shape of the float32 example input the module is traced with."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError as exc:
        raise config_error(f"--example {text!r} must be a shape like 1,3,224,224") from exc
    if not shape or min(shape) < 1:
        raise config_error(
            f"--example {text!r} must be a shape of positive sizes, like 1,3,224,224"
        )
    return shape


def load_factory(spec: str) -> Any:
    """``path/to/file.py:function``: the function that builds the module."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text)
    if not path_text or not name or not path.is_file():
        raise config_error(f"--module {spec!r} must be FILE.py:FUNCTION naming an existing file")
    module_spec = importlib.util.spec_from_file_location(f"package_model_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise config_error(f"--module {spec!r}: cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(path.parent.resolve()))
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise config_error(f"--module {spec!r}: {path} defines no function {name}")
    return factory


def export_module(spec: str, example_shape: tuple[int, ...], destination: Path) -> Path:
    """Builds the module, exports it with a dynamic first dimension and saves the program as
    ``destination``."""
    import torch

    model = load_factory(spec)()
    if not isinstance(model, torch.nn.Module):
        raise config_error(
            f"--module {spec!r} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    model.eval()
    # torch.export fixes a dimension it traces at size 1: trace the rows with at least two.
    example = torch.randn(max(2, example_shape[0]), *example_shape[1:])
    rows = torch.export.Dim("rows", min=1, max=1 << 16)
    try:
        with torch.no_grad():
            program = torch.export.export(model, (example,), dynamic_shapes=({0: rows},))
    except Exception as exc:  # boundary: the user's module cannot be traced; say why in one line
        raise config_error(
            f"torch.export could not trace {spec}: {str(exc).strip().splitlines()[0]}"
        ) from exc
    torch.export.save(program, str(destination))
    return destination


def aot_compile(source: Path, destination: Path) -> Path:
    """Compiles the exported program in ``source`` for the CPU into an AOTInductor package at
    ``destination``.

    CUDA packages must be compiled where a GPU is: serve the exported program with ``compile=true``
    and each executor compiles it for its card, once, into the container's compile cache."""
    import torch
    from torch._inductor import aoti_compile_and_package

    try:
        program = torch.export.load(str(source))
    except Exception as exc:
        # boundary: an AOTInductor package or a foreign file is not a program to compile
        reason = str(exc).strip().splitlines()[0]
        raise config_error(f"--aot needs an exported program in {source.name}: {reason}") from exc
    options = {"aot_inductor.metadata": _input_metadata(program)}
    return Path(
        aoti_compile_and_package(program, package_path=str(destination), inductor_configs=options)
    )


def _input_metadata(program: Any) -> dict[str, str]:
    """The rows the package takes (trailing shape and dtype), recorded so that the server refuses
    others with a 400: compiled code reads its input as laid out at compile time. Empty unless the
    program takes one tensor whose dimensions after the first are fixed."""
    import torch

    from mme_runtime.models.pt2 import input_metadata

    user_inputs = set(program.graph_signature.user_inputs)
    values = [
        node.meta.get("val")
        for node in program.graph.nodes
        if node.op == "placeholder" and node.name in user_inputs
    ]
    if len(values) != 1 or not isinstance(values[0], torch.Tensor):
        return {}
    example = values[0]
    if not all(isinstance(size, int) for size in example.shape[1:]):
        return {}
    return input_metadata(example.shape[1:], example.dtype)

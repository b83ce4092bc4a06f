"""PyTorch 2 artifacts served with no code: a ``model.pt2`` that holds a ``torch.export`` program or an AOTInductor
package. Both are PT2 archives; they are told apart by what they hold, never by the file name.

* An ``ExportedProgram`` (``torch.export.save``) loads on the host, in the CUDA-free loader like any other
  model, and its ``.module()`` is placed on each device host's device as usual.
* An AOTInductor package (``torch._inductor.aoti_compile_and_package``) is compiled code for one kind of device, so
  it is loaded in each device host, on its device, once: the loader only checks the archive.

Anything else, a corrupt file, or an archive written by an incompatible torch fails the LOAD with the cause.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch.export._tree_utils import reorder_kwargs

from mme_runtime.base.errors import InvalidInput, ModelLoadError, first_line

logger = logging.getLogger(__name__)

PT2_FILE = "model.pt2"
# Recorded in an AOTInductor package's metadata by package_model.py (``input_metadata``): the compiled code reads its
# input as laid out at compile time and checks nothing, so the server refuses other shapes and dtypes (400).
INPUT_SHAPE_KEY = "mme_input_shape"
INPUT_DTYPE_KEY = "mme_input_dtype"
Kind = Literal["exported_program", "aoti"]


def pt2_file(model_dir: Path) -> Path | None:
    path = model_dir / PT2_FILE
    return path if path.is_file() else None


def kind(path: Path) -> Kind:
    """What the archive holds; ``ModelLoadError`` naming the problem when it is no PT2 archive we can serve.

    Read with torch's zip reader itself, as ``torch.export.pt2_archive.PT2ArchiveReader`` does: importing that module
    imports the compiler (``torch._inductor``), which costs a LOAD more than a second for nothing."""
    constants = torch._C._export.pt2_archive_constants
    try:
        archive = torch._C.PyTorchFileReader(str(path))
        if archive.get_record(constants.ARCHIVE_FORMAT_PATH).decode() != constants.ARCHIVE_FORMAT_VALUE:
            raise ValueError("its format record is not a PT2 archive's")
        version = archive.get_record(constants.ARCHIVE_VERSION_PATH).decode()
        names = archive.get_all_records()
    except Exception as exc:  # boundary: torch's reader raises RuntimeError for a file that is not a zip archive
        reason = first_line(exc)
        raise ModelLoadError(f"{path.name} is not a PT2 archive ({reason})") from exc
    if version != constants.ARCHIVE_VERSION_VALUE:
        raise ModelLoadError(
            f"{path.name} was written in PT2 archive version {version}; torch {torch.__version__} reads version "
            f"{constants.ARCHIVE_VERSION_VALUE}: export it again with this torch"
        )
    if any(name.startswith(constants.AOTINDUCTOR_DIR) for name in names):
        return "aoti"
    if any(name.startswith(constants.MODELS_DIR) for name in names):
        return "exported_program"
    raise ModelLoadError(
        f"{path.name} is a PT2 archive with neither an exported program nor an AOTInductor package in it "
        "(save one with torch.export.save or torch._inductor.aoti_compile_and_package)"
    )


def input_metadata(row_shape: Sequence[int], dtype: torch.dtype) -> dict[str, str]:
    """What to record in a package compiled for inputs of rows of ``row_shape`` (the dimensions after the first)."""
    return {INPUT_SHAPE_KEY: ",".join(str(size) for size in row_shape), INPUT_DTYPE_KEY: str(dtype)}


def load(path: Path) -> Any:
    """The model the defaults serve from ``path``: an exported program's module, or an AOTInductor package to be
    loaded on each device host's device (``AOTIPackage.place``)."""
    found = kind(path)
    if found == "aoti":
        logger.info("%s: AOTInductor package, loaded on each device by its device host", path)
        return AOTIPackage(path)
    try:
        return torch.export.load(str(path)).module()
    except Exception as exc:  # boundary: the LOAD fails with torch's reason (an opset or schema it cannot read)
        reason = first_line(exc)
        raise ModelLoadError(f"{path.name}: the exported program cannot be loaded: {reason}") from exc


@dataclass(frozen=True)
class AOTIPackage:
    """An AOTInductor package not yet loaded: compiled for one device kind, so each device host loads it on its own."""

    path: Path

    def place(self, device: torch.device) -> AOTIRunner:
        """The package loaded on ``device`` (``cuda:0`` in a GPU's host, which sees only its GPU, or the CPU)."""
        try:
            return AOTIRunner(self.path, device)
        except Exception as exc:  # boundary: compiled for another device kind, or for another torch
            reason = first_line(exc)
            raise ModelLoadError(f"{self.path.name}: the AOTInductor package cannot run on {device}: {reason}") from exc


class AOTIRunner:
    """An AOTInductor package loaded for one device, called like the module it was compiled from.

    torch's ``aoti_load_package`` wraps the same C++ loader, but first imports the compiler (``torch._inductor``, and
    with it ``torch._dynamo``): 1.5 s of every LOAD on a CPU host, to run code that is already compiled. This calls
    the loader directly and keeps torch's calling convention (``AOTICompiledModel``): tensors flattened in, the
    outputs rebuilt by the package's own tree spec."""

    def __init__(self, path: Path, device: torch.device) -> None:
        loader_class: Any = torch._C._aoti.AOTIModelPackageLoader  # its static metadata reader is not in the stubs
        metadata = dict(loader_class.load_metadata_from_package(str(path), "model"))
        _check_device(metadata, device)
        index = device.index if device.type == "cuda" and device.index is not None else -1
        # (package, model name in it, run single-threaded, runners, device index): aoti_load_package's defaults.
        self._loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, index)
        in_spec, out_spec = self._loader.get_call_spec()
        self._in_spec = pytree.treespec_loads(in_spec)
        self._out_spec = pytree.treespec_loads(out_spec)
        shape = metadata.get(INPUT_SHAPE_KEY)
        self._input = None if shape is None else (_shape(shape), metadata.get(INPUT_DTYPE_KEY))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._input is not None and len(args) == 1 and isinstance(args[0], torch.Tensor):
            shape, dtype = self._input
            data = args[0]
            if tuple(data.shape[1:]) != shape or str(data.dtype) != dtype or data.dim() == 0:
                raise InvalidInput(
                    f"the model takes rows of shape {list(shape)} and dtype {dtype}; "
                    f"got shape {list(data.shape)} and dtype {data.dtype}"
                )
        flat = pytree.tree_flatten((args, reorder_kwargs(kwargs, self._in_spec)))[0]
        outputs = self._loader.boxed_run([value for value in flat if isinstance(value, torch.Tensor)])
        return pytree.tree_unflatten(outputs, self._out_spec)

    def get_constant_fqns(self) -> list[str]:
        return list(self._loader.get_constant_fqns())

    def load_constants(self, tensors: dict[str, torch.Tensor], user_managed: bool) -> None:
        """Points the compiled code at ``tensors`` (every constant it needs), kept by the caller if ``user_managed``."""
        # (constants, use the inactive buffer, check every constant is given, user managed, allow host-to-device copy)
        self._loader.load_constants(tensors, False, True, user_managed, False)


def _check_device(metadata: dict[str, str], device: torch.device) -> None:
    """Compiled code runs only on the kind of device, and the GPU architecture, it was compiled for."""
    compiled_for = metadata.get("AOTI_DEVICE_KEY")
    if compiled_for and compiled_for != device.type:
        raise ValueError(f"it was compiled for {compiled_for}")
    capability = metadata.get("AOTI_COMPUTE_CAPABILITY")
    if device.type == "cuda" and capability:
        major, minor = torch.cuda.get_device_capability(device)
        if capability != f"{major}{minor}":
            raise ValueError(f"it was compiled for GPUs of compute capability {capability}, this one is {major}{minor}")


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(size) for size in text.split(",")) if text else ()

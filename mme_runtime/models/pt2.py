"""PyTorch 2 artifacts served with no code: a ``model.pt2`` that holds a ``torch.export`` program or
an AOTInductor package, told apart by what they hold, never by the file name; and ``compile=true``,
a model compiled ahead of time for its device with AOTInductor, once, and kept in the cache.

* An ``ExportedProgram`` (``torch.export.save``) loads on the host, in the CUDA-free loader like any
  other model, and its ``.module()`` is placed on each device host's device as usual.
* An AOTInductor package (``torch._inductor.aoti_compile_and_package``) is compiled code for one
  kind of device, so it is loaded in each device host, on its device, once: the loader only checks
  the archive.
* ``compile=true`` in ``serving.properties``: each device host exports the placed model on its
  warm-up sample (first dimension dynamic) and compiles it for its device, once per content and
  device kind (``compile_model``).

Anything else, a corrupt file, or an archive written by an incompatible torch fails the LOAD with
the cause.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch.export._tree_utils import reorder_kwargs

from mme_runtime.base.errors import InvalidInput, ModelLoadError, first_line
from mme_runtime.base.locks import build_once, discard
from mme_runtime.models.serving_properties import ServingSettings
from mme_runtime.operations import metrics

logger = logging.getLogger(__name__)

PT2_FILE = "model.pt2"
# Recorded in an AOTInductor package's metadata by package_model.py (``input_metadata``): the
# compiled code reads its input as laid out at compile time and checks nothing, so the server
# refuses other shapes and dtypes (400).
INPUT_SHAPE_KEY = "mme_input_shape"
INPUT_DTYPE_KEY = "mme_input_dtype"
Kind = Literal["exported_program", "aoti"]


def pt2_file(model_dir: Path) -> Path | None:
    path = model_dir / PT2_FILE
    return path if path.is_file() else None


def kind(path: Path) -> Kind:
    """What the archive holds; ``ModelLoadError`` naming the problem when it is no PT2 archive we
    can serve.

    Read with torch's zip reader itself, as ``torch.export.pt2_archive.PT2ArchiveReader`` does:
    importing that module imports the compiler (``torch._inductor``), which costs a LOAD more than a
    second for nothing."""
    constants = torch._C._export.pt2_archive_constants
    try:
        archive = torch._C.PyTorchFileReader(str(path))
        if (
            archive.get_record(constants.ARCHIVE_FORMAT_PATH).decode()
            != constants.ARCHIVE_FORMAT_VALUE
        ):
            raise ValueError("its format record is not a PT2 archive's")
        version = archive.get_record(constants.ARCHIVE_VERSION_PATH).decode()
        names = archive.get_all_records()
    except Exception as exc:
        # boundary: torch's reader raises RuntimeError for a file that is not a zip archive
        reason = first_line(exc)
        raise ModelLoadError(f"{path.name} is not a PT2 archive ({reason})") from exc
    if version != constants.ARCHIVE_VERSION_VALUE:
        raise ModelLoadError(
            f"{path.name} was written in PT2 archive version {version}; torch {torch.__version__} "
            f"reads version {constants.ARCHIVE_VERSION_VALUE}: export it again with this torch"
        )
    if any(name.startswith(constants.AOTINDUCTOR_DIR) for name in names):
        return "aoti"
    if any(name.startswith(constants.MODELS_DIR) for name in names):
        return "exported_program"
    raise ModelLoadError(
        f"{path.name} is a PT2 archive with neither an exported program nor an AOTInductor package "
        "in it (save one with torch.export.save or torch._inductor.aoti_compile_and_package)"
    )


def input_metadata(row_shape: Sequence[int], dtype: torch.dtype) -> dict[str, str]:
    """What to record in a package compiled for inputs of rows of ``row_shape`` (the dimensions
    after the first)."""
    return {INPUT_SHAPE_KEY: ",".join(str(size) for size in row_shape), INPUT_DTYPE_KEY: str(dtype)}


def load(path: Path) -> Any:
    """The model the defaults serve from ``path``: an exported program's module, or an AOTInductor
    package to be loaded on each device host's device (``AOTIPackage.place``)."""
    found = kind(path)
    if found == "aoti":
        logger.info("%s: AOTInductor package, loaded on each device by its device host", path)
        return AOTIPackage(path)
    try:
        return torch.export.load(str(path)).module()
    except Exception as exc:
        # boundary: the LOAD fails with torch's reason (an opset or schema it cannot read)
        reason = first_line(exc)
        raise ModelLoadError(
            f"{path.name}: the exported program cannot be loaded: {reason}"
        ) from exc


@dataclass(frozen=True)
class AOTIPackage:
    """An AOTInductor package not yet loaded: compiled for one device kind, so each device host
    loads it on its own."""

    path: Path

    def place(self, device: torch.device) -> AOTIRunner:
        """The package loaded on ``device`` (``cuda:0`` in a GPU's host, which sees only its GPU, or
        the CPU)."""
        try:
            return AOTIRunner(self.path, device)
        except Exception as exc:  # boundary: compiled for another device kind, or for another torch
            reason = first_line(exc)
            raise ModelLoadError(
                f"{self.path.name}: the AOTInductor package cannot run on {device}: {reason}"
            ) from exc


class AOTIRunner:
    """An AOTInductor package loaded for one device, called like the module it was compiled from.

    torch's ``aoti_load_package`` wraps the same C++ loader, but first imports the compiler
    (``torch._inductor``, and with it ``torch._dynamo``): 1.5 s of every LOAD on a CPU host, to run
    code that is already compiled. This calls the loader directly and keeps torch's calling
    convention (``AOTICompiledModel``): tensors flattened in, the outputs rebuilt by the package's
    own tree spec."""

    def __init__(self, path: Path, device: torch.device) -> None:
        # its static metadata reader is not in the stubs
        loader_class: Any = torch._C._aoti.AOTIModelPackageLoader
        metadata = dict(loader_class.load_metadata_from_package(str(path), "model"))
        _check_device(metadata, device)
        index = device.index if device.type == "cuda" and device.index is not None else -1
        # (package, model name in it, run single-threaded, runners, device index):
        # aoti_load_package's defaults.
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
        outputs = self._loader.boxed_run(
            [value for value in flat if isinstance(value, torch.Tensor)]
        )
        return pytree.tree_unflatten(outputs, self._out_spec)

    def get_constant_fqns(self) -> list[str]:
        return list(self._loader.get_constant_fqns())

    def load_constants(self, tensors: dict[str, torch.Tensor], user_managed: bool) -> None:
        """Points the compiled code at ``tensors`` (every constant it needs), kept by the caller if
        ``user_managed``."""
        # (constants, use the inactive buffer, check every constant is given, user managed, allow
        # host-to-device copy)
        self._loader.load_constants(tensors, False, True, user_managed, False)


def _check_device(metadata: dict[str, str], device: torch.device) -> None:
    """Compiled code runs only on the kind of device, and the GPU architecture, it was compiled
    for."""
    compiled_for = metadata.get("AOTI_DEVICE_KEY")
    if compiled_for and compiled_for != device.type:
        raise ValueError(f"it was compiled for {compiled_for}")
    capability = metadata.get("AOTI_COMPUTE_CAPABILITY")
    if device.type == "cuda" and capability:
        major, minor = torch.cuda.get_device_capability(device)
        if capability != f"{major}{minor}":
            raise ValueError(
                f"it was compiled for GPUs of compute capability {capability}, this one is "
                f"{major}{minor}"
            )


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(size) for size in text.split(",")) if text else ()


PACKAGE = "model.pt2"
CHUNK_BYTES = 1 << 20
# torch.compile's mode names, as AOTInductor options.
MODE_OPTIONS: dict[str, dict[str, Any]] = {"default": {}, "max-autotune": {"max_autotune": True}}


def artifacts_digest(model_dir: Path) -> str:
    """SHA-256 over the model directory's files (names and contents), code included: what the model
    is made of."""
    digest = hashlib.sha256()
    for path in sorted(
        p for p in model_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    ):
        digest.update(str(path.relative_to(model_dir)).encode() + b"\0")
        with path.open("rb") as stream:
            while chunk := stream.read(CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def cache_key(
    model_dir: Path, device: torch.device, settings: ServingSettings, sample: torch.Tensor
) -> str:
    parts = [
        artifacts_digest(model_dir),
        torch.__version__,
        device_kind(device),
        settings.compile_mode,
        str(tuple(sample.shape[1:])),
        str(sample.dtype),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def device_kind(device: torch.device) -> str:
    """What compiled code is specific to: the GPU's architecture and CUDA version, or the CPU model
    and its instruction set extensions (AOTInductor compiles CPU code for the host's own,
    ``-march=native``: it stops with SIGILL on a CPU without one of them, and a cache directory may
    be shared by hosts)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda sm_{major}{minor} cuda {torch.version.cuda}"
    return f"{device.type} {platform.machine()} {_cpu_identity()}"


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))][:2]
    return hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:16]


def compile_model(
    model: Any,
    model_name: str,
    model_dir: Path,
    device: torch.device,
    settings: ServingSettings,
    sample: Any,
    cache_dir: Path,
) -> Any:
    """The model compiled for ``device`` (from the cache when it holds it), or ``model`` itself when
    it cannot be."""
    if not isinstance(model, torch.nn.Module) or isinstance(model, torch.jit.ScriptModule):
        return _eager(
            model_name,
            f"it is a {type(model).__name__}, not an nn.Module torch.export can trace",
            model,
        )
    if not isinstance(sample, torch.Tensor) or sample.dim() == 0:
        return _eager(
            model_name, "its warm-up sample does not decode to one tensor with rows", model
        )
    started = time.monotonic()
    entry = cache_dir / "compiled" / cache_key(model_dir, device, settings, sample)
    entry.parent.mkdir(parents=True, exist_ok=True)
    try:
        build = lambda staging: _compile_into(staging, model, device, settings, sample)  # noqa: E731
        built = build_once(entry, build)
        metrics.record_cache_lookup("compiled", hit=not built)
        try:
            runner = AOTIRunner(entry / PACKAGE, device)
        except Exception as exc:  # noqa: BLE001
            # a cache entry that does not load (damaged, say) is built again
            if built:
                raise
            logger.warning(
                "model=%s compile cache entry %s unusable (%s): compiling again",
                model_name,
                entry,
                exc,
            )
            discard(entry)
            built = build_once(entry, build)
            runner = AOTIRunner(entry / PACKAGE, device)
        compiled = CompiledModule(model, runner, sample.to(device))
    except Exception as exc:
        # boundary: a compile that fails leaves the model eager, never fails the LOAD
        reason = first_line(exc)
        logger.debug("model=%s compile failed", model_name, exc_info=exc)
        return _eager(model_name, f"{type(exc).__name__}: {reason}", model)
    logger.info(
        "model=%s compiled for %s mode=%s %s seconds=%.2f",
        model_name,
        device,
        settings.compile_mode,
        "compiled now, stored in the cache" if built else "loaded from the compile cache",
        time.monotonic() - started,
    )
    return compiled


def _compile_into(
    staging: Path,
    model: torch.nn.Module,
    device: torch.device,
    settings: ServingSettings,
    sample: torch.Tensor,
) -> Path:
    from torch._inductor import aoti_compile_and_package  # heavy (1.5 s): imported only to compile

    if sample.shape[0] == 1:
        # torch.export fixes a dimension traced at size 1: trace with two rows
        sample = torch.cat([sample, sample])
    # DYNAMIC, not a named range: a module exported before (an ExportedProgram's) brings its own
    # bounds for the rows.
    with torch.no_grad():
        program = torch.export.export(
            model, (sample.to(device),), dynamic_shapes=({0: torch.export.Dim.DYNAMIC},)
        )
    package = staging / "package"
    package.mkdir()
    # Weights stay out of the package: the runner is given the placed module's tensors (no second
    # copy).
    options = {**MODE_OPTIONS[settings.compile_mode], "aot_inductor.package_constants_in_so": False}
    aoti_compile_and_package(program, package_path=str(package / PACKAGE), inductor_configs=options)
    return package


class CompiledModule(torch.nn.Module):
    """The user's module, its forward run by the AOTInductor runner: parameters, buffers and other
    attributes are the module's own, for user code that reads them
    (``next(model.parameters()).device``, say).

    The compiled code was traced for the sample's trailing shape, dtype and device (only the rows
    vary) and does not check what it is given: any other input runs the module eager, as it would
    without ``compile=true``."""

    def __init__(self, module: torch.nn.Module, runner: AOTIRunner, sample: torch.Tensor) -> None:
        super().__init__()
        self.module = module
        self.traced_for = (tuple(sample.shape[1:]), sample.dtype, sample.device)
        tensors = _tensors(module)
        missing = [name for name in runner.get_constant_fqns() if name not in tensors]
        if missing:
            raise ValueError(
                "the compiled code needs tensors the module keeps outside its parameters and "
                f"buffers: {missing[:3]}"
            )
        # What the compiled code was built for, per tensor: it reads them in place, as then laid
        # out, checking nothing.
        self.constants = {name: _layout(tensors[name]) for name in runner.get_constant_fqns()}
        self._point(runner, tensors)
        self.runner: AOTIRunner | None = runner

    def _point(self, runner: AOTIRunner, tensors: dict[str, torch.Tensor]) -> None:
        runner.load_constants({name: tensors[name] for name in self.constants}, user_managed=True)
        self.pointers = {name: tensors[name].data_ptr() for name in self.constants}

    def _apply(self, fn: Any, recurse: bool = True) -> CompiledModule:
        """``.to()``, ``.half()``, ``.cuda()``: the module's tensors are new ones, so the compiled
        code is pointed at them, or, when they no longer have the dtype, device, shape and layout it
        was built for, left aside: the module runs eager."""
        # a forward on another thread runs eager while the tensors change
        runner, self.runner = self.runner, None
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        if runner is not None:
            tensors = _tensors(self.module)
            if all(tensors[name].data_ptr() == pointer for name, pointer in self.pointers.items()):
                # .to() the device it is on already (the AWS-style predict_fn does it each call)
                self.runner = runner
            elif all(_layout(tensors[name]) == built for name, built in self.constants.items()):
                self._point(runner, tensors)
                self.runner = runner
            else:
                logger.warning("compiled model moved or converted: it runs eager from now on")
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runner = self.runner  # read once: _apply may set it aside meanwhile
        if (
            runner is not None
            and len(args) == 1
            and not kwargs
            and isinstance(args[0], torch.Tensor)
        ):
            data = args[0]
            if (tuple(data.shape[1:]), data.dtype, data.device) == self.traced_for and data.shape[
                0
            ] >= 1:
                return runner(data)
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


def _layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (tensor.dtype, tensor.device, tuple(tensor.shape), tensor.stride())


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _eager(model_name: str, reason: str, model: Any) -> Any:
    logger.warning("model=%s compile=true: serving eager, not compiled: %s", model_name, reason)
    return model

"""``compile=true``: a model compiled ahead of time for its device with AOTInductor, once, and kept in the cache.

Each device host exports the placed model with ``torch.export`` on the model's warm-up sample (its first dimension
dynamic, so any number of rows and any batch fits), compiles the program with AOTInductor and loads the package.
The package holds code, not weights: the compiled model reads the placed module's own tensors, so compiling costs
no second copy of the weights, and user code that asks the model for its parameters still finds them. The
package is stored under ``MME_CACHE_DIR/compiled/`` keyed by the model directory's content, the torch version, the
device kind, the compile mode and the sample's trailing shape and dtype: a later LOAD of the same artifacts, under
another name or after a restart, loads the package and compiles nothing. Whatever fails (a model torch.export cannot
trace, a compiler error) leaves the model eager, with the reason in the log: a compile never fails a LOAD.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import time
from pathlib import Path
from typing import Any

import torch

from mme_runtime.base.errors import first_line
from mme_runtime.base.locks import build_once, discard
from mme_runtime.models.pt2 import AOTIRunner
from mme_runtime.models.serving_properties import ServingSettings
from mme_runtime.operations import metrics

logger = logging.getLogger(__name__)

PACKAGE = "model.pt2"
CHUNK_BYTES = 1 << 20
# torch.compile's mode names, as AOTInductor options.
MODE_OPTIONS: dict[str, dict[str, Any]] = {"default": {}, "max-autotune": {"max_autotune": True}}


def artifacts_digest(model_dir: Path) -> str:
    """SHA-256 over the model directory's files (names and contents), code included: what the model is made of."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(model_dir)).encode() + b"\0")
        with path.open("rb") as stream:
            while chunk := stream.read(CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def cache_key(model_dir: Path, device: torch.device, settings: ServingSettings, sample: torch.Tensor) -> str:
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
    """What compiled code is specific to: the GPU's architecture and CUDA version, or the CPU model and its
    instruction set extensions (AOTInductor compiles CPU code for the host's own, ``-march=native``: it stops with
    SIGILL on a CPU without one of them, and a cache directory may be shared by hosts)."""
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
    """The model compiled for ``device`` (from the cache when it holds it), or ``model`` itself when it cannot be."""
    if not isinstance(model, torch.nn.Module) or isinstance(model, torch.jit.ScriptModule):
        return _eager(model_name, f"it is a {type(model).__name__}, not an nn.Module torch.export can trace", model)
    if not isinstance(sample, torch.Tensor) or sample.dim() == 0:
        return _eager(model_name, "its warm-up sample does not decode to one tensor with rows", model)
    started = time.monotonic()
    entry = cache_dir / "compiled" / cache_key(model_dir, device, settings, sample)
    entry.parent.mkdir(parents=True, exist_ok=True)
    try:
        build = lambda staging: _compile_into(staging, model, device, settings, sample)  # noqa: E731
        built = build_once(entry, build)
        metrics.record_cache_lookup("compiled", hit=not built)
        try:
            runner = AOTIRunner(entry / PACKAGE, device)
        except Exception as exc:  # noqa: BLE001 - a cache entry that does not load (damaged, say) is built again
            if built:
                raise
            logger.warning("model=%s compile cache entry %s unusable (%s): compiling again", model_name, entry, exc)
            discard(entry)
            built = build_once(entry, build)
            runner = AOTIRunner(entry / PACKAGE, device)
        compiled = CompiledModule(model, runner, sample.to(device))
    except Exception as exc:  # boundary: a compile that fails leaves the model eager, never fails the LOAD
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
    staging: Path, model: torch.nn.Module, device: torch.device, settings: ServingSettings, sample: torch.Tensor
) -> Path:
    from torch._inductor import aoti_compile_and_package  # heavy (1.5 s): imported only to compile

    if sample.shape[0] == 1:
        sample = torch.cat([sample, sample])  # torch.export fixes a dimension traced at size 1: trace with two rows
    # DYNAMIC, not a named range: a module exported before (an ExportedProgram's) brings its own bounds for the rows.
    with torch.no_grad():
        program = torch.export.export(model, (sample.to(device),), dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
    package = staging / "package"
    package.mkdir()
    # Weights stay out of the package: the runner is given the placed module's tensors (no second copy).
    options = {**MODE_OPTIONS[settings.compile_mode], "aot_inductor.package_constants_in_so": False}
    aoti_compile_and_package(program, package_path=str(package / PACKAGE), inductor_configs=options)
    return package


class CompiledModule(torch.nn.Module):
    """The user's module, its forward run by the AOTInductor runner: parameters, buffers and other attributes are
    the module's own, for user code that reads them (``next(model.parameters()).device``, say).

    The compiled code was traced for the sample's trailing shape, dtype and device (only the rows vary) and does not
    check what it is given: any other input runs the module eager, as it would without ``compile=true``."""

    def __init__(self, module: torch.nn.Module, runner: AOTIRunner, sample: torch.Tensor) -> None:
        super().__init__()
        self.module = module
        self.traced_for = (tuple(sample.shape[1:]), sample.dtype, sample.device)
        tensors = _tensors(module)
        missing = [name for name in runner.get_constant_fqns() if name not in tensors]
        if missing:
            raise ValueError(
                f"the compiled code needs tensors the module keeps outside its parameters and buffers: {missing[:3]}"
            )
        # What the compiled code was built for, per tensor: it reads them in place, as then laid out, checking nothing.
        self.constants = {name: _layout(tensors[name]) for name in runner.get_constant_fqns()}
        self._point(runner, tensors)
        self.runner: AOTIRunner | None = runner

    def _point(self, runner: AOTIRunner, tensors: dict[str, torch.Tensor]) -> None:
        runner.load_constants({name: tensors[name] for name in self.constants}, user_managed=True)
        self.pointers = {name: tensors[name].data_ptr() for name in self.constants}

    def _apply(self, fn: Any, recurse: bool = True) -> CompiledModule:
        """``.to()``, ``.half()``, ``.cuda()``: the module's tensors are new ones, so the compiled code is pointed at
        them, or, when they no longer have the dtype, device, shape and layout it was built for, left aside: the module
        runs eager."""
        runner, self.runner = self.runner, None  # a forward on another thread runs eager while the tensors change
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        if runner is not None:
            tensors = _tensors(self.module)
            if all(tensors[name].data_ptr() == pointer for name, pointer in self.pointers.items()):
                self.runner = runner  # .to() the device it is on already (the AWS-style predict_fn does it each call)
            elif all(_layout(tensors[name]) == built for name, built in self.constants.items()):
                self._point(runner, tensors)
                self.runner = runner
            else:
                logger.warning("compiled model moved or converted: it runs eager from now on")
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runner = self.runner  # read once: _apply may set it aside meanwhile
        if runner is not None and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            data = args[0]
            if (tuple(data.shape[1:]), data.dtype, data.device) == self.traced_for and data.shape[0] >= 1:
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

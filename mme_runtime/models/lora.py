"""PEFT LoRA adapters served with no code: a directory with ``adapter_config.json`` and
``adapter_model.safetensors`` is a model of its own over a base model, which is loaded once
(``model_fn`` loads the base; equal bases are one package, ``package_cache.py``, and their tensors
one copy, ``tensor_store.py``).

``read_adapter`` reads and checks an adapter, ``base_directory`` finds its base, and ``attach``
serves it over the base, row by row: each wrapped layer adds, for each row of a pass, the delta of
that row's adapter, gathered in one batched product (no Python loop over adapters inside a pass), so
the rows of many adapters share their passes.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.models.code_fetcher import CodeFetcher

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
# What makes a directory a base: a Hugging Face model's config, or a PyTorch model's file.
BASE_FILES = ("config.json", "model.pt", "model.pth")
# Where PEFT records the base an adapter was trained over: a hub id, or the path it was loaded from.
RECORDED_BASE = "base_model_name_or_path"
# PEFT's task types and the Hugging Face tasks they are served as.
TASK_TYPES = {
    "SEQ_CLS": "text-classification",
    "TOKEN_CLS": "token-classification",
    "FEATURE_EXTRACTION": "feature-extraction",
}
# Options whose effect this server does not reproduce: an adapter that sets one fails its LOAD
# rather than answer wrong.
UNSUPPORTED = (
    "use_dora",
    "layers_to_transform",
    "layer_replication",
    "lora_bias",
    "target_parameters",
    "use_qalora",
)


def is_adapter_directory(model_dir: Path) -> bool:
    return (model_dir / CONFIG_FILE).is_file()


@dataclass
class Adapter:
    """One adapter's tensors: ``lora`` maps a module path to its (A, B, scaling); ``saved`` maps a
    module path to the state of the whole module the adapter replaces (PEFT's ``modules_to_save``, a
    classification head)."""

    task: str | None
    lora: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    saved: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tensors = [t for a, b, _ in self.lora.values() for t in (a, b)]
        tensors += [t for state in self.saved.values() for t in state.values()]
        return sum(tensor.nbytes for tensor in tensors)


def read_adapter(model_dir: Path) -> Adapter:
    """The adapter in ``model_dir``; ``ModelLoadError`` naming the problem when it is not one this
    server serves."""
    from safetensors.torch import load_file

    try:
        config = json.loads((model_dir / CONFIG_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(model_dir / WEIGHT_FILE))
    except FileNotFoundError as exc:
        raise ModelLoadError(
            f"an adapter needs {CONFIG_FILE} and {WEIGHT_FILE}: {exc.filename} is missing"
        ) from exc
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"the adapter in {model_dir.name} cannot be read: {exc}") from exc
    if config.get("peft_type") != "LORA":
        raise ModelLoadError(
            f"peft_type {config.get('peft_type')!r} is not served: only LORA adapters are"
        )
    for option in UNSUPPORTED:
        if config.get(option):
            raise ModelLoadError(f"adapter option {option}={config[option]!r} is not served")
    if config.get("bias", "none") != "none":
        raise ModelLoadError(f"adapter option bias={config['bias']!r} is not served (only 'none')")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    lora: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        path = key.removeprefix(PREFIX)
        if ".lora_A." in path:
            module = path.split(".lora_A.")[0]
            up = tensors.get(f"{PREFIX}{module}.lora_B.weight")
            if up is None:
                raise ModelLoadError(f"the adapter has lora_A for {module} but no lora_B")
            r, a = _pattern(ranks, module, rank), _pattern(alphas, module, alpha)
            scaling = a / r**0.5 if config.get("use_rslora") else a / r
            # (A: rank x in, B: out x rank); fan_in_fan_out is Conv1D's: refused
            lora[module] = (tensor, up, scaling)
        elif ".lora_B." not in path:
            module, _, parameter = path.rpartition(".")
            saved.setdefault(module, {})[parameter] = tensor
    if not lora:
        raise ModelLoadError(
            f"{WEIGHT_FILE} holds no LoRA matrices (keys like {PREFIX}<module>.lora_A.weight)"
        )
    return Adapter(TASK_TYPES.get(config.get("task_type") or ""), lora, saved)


def _pattern(pattern: dict[str, Any], module: str, default: float) -> float:
    """PEFT's ``rank_pattern``/``alpha_pattern``: the first key that the module's path ends with."""
    for key, value in pattern.items():
        if re.search(rf"(^|\.){re.escape(key)}$", module):
            return float(value)
    return default


def find_base(model_dir: Path, base_model: str | None, config: Config) -> Path:
    """The adapter's base directory (``base_directory``), or for
    ``base_model=s3://bucket/key.tar.gz`` the archive fetched once per ETag into
    ``MME_CACHE_DIR/bases`` (``code_fetcher.py``): its top, or its one directory that holds a
    model."""
    if base_model is not None and base_model.startswith("s3://"):
        fetched = CodeFetcher(config.cache_dir / "bases", config.s3_timeout_seconds).fetch(
            base_model
        )
        return (
            fetched if _holds_model(fetched) else _one_inside(fetched, f"the archive {base_model}")
        )
    anywhere = config.allow_any_model_location or not config.multi_model
    return base_directory(model_dir, base_model, config.model_root, anywhere)


def base_directory(
    model_dir: Path, base_model: str | None, model_root: Path, anywhere: bool = False
) -> Path:
    """The adapter's local base, the first that is given of (docs/sharing.md#lora-adapters):
    ``base_model=`` in its ``serving.properties`` (relative to the adapter, or absolute); the one
    directory inside the adapter's that holds a model (a Hugging Face ``config.json``, or a PyTorch
    ``model.pt``/``model.pth`` with the ``code/`` that builds it); the base PEFT recorded in its
    ``adapter_config.json``, where that names a model here. Under ``model_root`` unless
    ``anywhere``. A JSON read and a few stats, never S3: the warm process keys packages with it."""
    root = model_root.resolve()
    if base_model is not None:
        candidate = Path(base_model) if Path(base_model).is_absolute() else (model_dir / base_model)
        base = candidate.resolve()
        allowed = anywhere or base.is_relative_to(root)
        if not (allowed or base.is_relative_to(model_dir.resolve())):
            raise ModelLoadError(
                f"base_model={base_model} is outside the model root {model_root}", status=400
            )
        if not _holds_model(base):
            message = (
                f"base_model={base_model}: no model there (no config.json, model.pt or model.pth "
                f"in {base})"
            )
            raise ModelLoadError(message, status=400)
        return base
    inside = _models_inside(model_dir)
    if len(inside) == 1:
        return inside[0]
    name = _recorded_base(model_dir)
    tried: list[str] = []
    for candidate in _named_candidates(model_dir, name, root):
        if not (anywhere or candidate.is_relative_to(root)):
            tried.append(f"{candidate} is outside the model root")
        elif _holds_model(candidate):
            return candidate
        else:
            why = "holds no model" if candidate.is_dir() else "is not there"
            tried.append(f"{candidate} {why}")
    raise ModelLoadError(_unknown_base(name, tried, inside), status=400)


def _unknown_base(name: str | None, tried: list[str], inside: list[Path]) -> str:
    """What was looked for, and the two ways to name the base."""
    if name:
        recorded = (
            f"{RECORDED_BASE} in its {CONFIG_FILE} is {name!r}, which names no model here "
            f"({', '.join([*tried, 'and nothing is downloaded from the Hugging Face Hub'])})"
        )
    else:
        recorded = f"its {CONFIG_FILE} names none ({RECORDED_BASE})"
    shipped = "no directory inside the adapter's holds a model"
    if inside:
        shipped = f"several inside the adapter's do ({', '.join(path.name for path in inside)})"
    return (
        f"the adapter's base is not known: {recorded}; {shipped}. Set base_model=<directory or "
        "s3://...tar.gz> in the adapter's serving.properties, or ship the base as one directory "
        "inside the adapter's (the same archive)"
    )


def _recorded_base(model_dir: Path) -> str | None:
    """The base PEFT wrote when it saved the adapter: a hub id, or the path it was loaded from."""
    try:
        config = json.loads((model_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"the adapter in {model_dir.name} cannot be read: {exc}") from exc
    name = config.get(RECORDED_BASE) if isinstance(config, dict) else None
    return (name.strip() or None) if isinstance(name, str) else None


def _named_candidates(model_dir: Path, name: str | None, root: Path) -> list[Path]:
    """Where a recorded base may be: an absolute path as it is; a relative name (``base``, a hub id
    such as ``org/model``) beside the adapter, then under the model root."""
    if not name or "\0" in name:
        return []
    if Path(name).is_absolute():
        return [Path(name).resolve()]
    nearest = [model_dir.resolve().parent / name, root / name]
    return list(dict.fromkeys(path.resolve() for path in nearest))


def _models_inside(directory: Path) -> list[Path]:
    return sorted(path for path in directory.iterdir() if path.is_dir() and _holds_model(path))


def _one_inside(directory: Path, where: str) -> Path:
    inside = _models_inside(directory)
    if len(inside) != 1:
        found = "none" if not inside else ", ".join(path.name for path in inside)
        raise ModelLoadError(
            "the adapter's base is not known: set base_model=<directory or s3://...tar.gz> in its "
            f"serving.properties, or ship the base as one directory inside {where} (found: "
            f"{found})",
            status=400,
        )
    return inside[0]


def _holds_model(directory: Path) -> bool:
    return any((directory / name).is_file() for name in BASE_FILES)


class LoraLinear(torch.nn.Module):
    """A base linear layer and the low-rank updates of the adapters that target it, picked row by
    row."""

    def __init__(self, base: torch.nn.Linear, adapters: AdapterSet) -> None:
        super().__init__()
        self.base = base
        self.adapters = adapters
        self.updates: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.base(x)
        for index, rows in self.adapters.groups.items():
            update = self.updates.get(index)
            if update is not None:
                down, up, scaling = update
                if rows is None:
                    result += (x @ down.T @ up.T) * scaling
                else:
                    result.index_add_(0, rows, (x.index_select(0, rows) @ down.T @ up.T) * scaling)
        return result


class SavedModule(torch.nn.Module):
    """A module some adapters replace whole (a classification head): each row goes through its
    adapter's copy."""

    def __init__(self, base: torch.nn.Module, adapters: AdapterSet) -> None:
        super().__init__()
        self.base = base
        self.adapters = adapters
        self.copies: dict[int, torch.nn.Module] = {}

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result: torch.Tensor = self.base(x, *args, **kwargs)
        for index, rows in self.adapters.groups.items():
            own = self.copies.get(index)
            if own is None:
                continue
            if rows is None:
                result = own(x, *args, **kwargs)
            else:
                result.index_copy_(0, rows, own(x.index_select(0, rows), *args, **kwargs))
        return result


class AdapterSet:
    """The adapters over one base module, and which adapter each row of the pass under way uses. One
    pass at a time: ``selecting`` holds a lock for the pass (the adapters' shared batcher runs one
    anyway)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.index: dict[str, int] = {}
        # adapter -> the rows of the pass that use it (None: all)
        self.groups: dict[int, torch.Tensor | None] = {}
        self.pass_lock = threading.Lock()
        self._lock = threading.Lock()
        self._next = 0
        self._batcher: Any = None  # the one queue of every adapter's model (``serving/batcher.py``)
        self._users: set[str] = set()

    def add(self, name: str, adapter: Adapter) -> None:
        """Wraps the layers the adapter targets (once per layer) and gives them its tensors, on the
        module's device."""
        with self._lock:
            modules = dict(self.module.named_modules())
            missing = [path for path in (*adapter.lora, *adapter.saved) if path not in modules]
            if missing:
                names = ", ".join(missing[:5])
                raise ModelLoadError(
                    f"the adapter targets modules the base does not have: {names}", status=400
                )
            index, self._next = self._next, self._next + 1
            for path, (down, up, scaling) in adapter.lora.items():
                layer = self._wrapped(path, modules, LoraLinear)
                device, dtype = layer.base.weight.device, layer.base.weight.dtype
                layer.updates[index] = (down.to(device, dtype), up.to(device, dtype), scaling)
            for path, state in adapter.saved.items():
                holder = self._wrapped(path, modules, SavedModule)
                holder.copies[index] = _replaced(holder.base, state, path)
            self.index[name] = index

    def batcher(self, name: str, make: Callable[[], Any]) -> Any:
        """The batcher every adapter's model submits to, made by the first (``make``)."""
        with self._lock:
            if self._batcher is None:
                self._batcher = make()
            self._users.add(name)
            return self._batcher

    def leave(self, name: str) -> None:
        """``name``'s model is unloaded: its adapter goes, and the shared batcher with the last of
        them."""
        self.remove(name)
        with self._lock:
            self._users.discard(name)
            batcher, last = self._batcher, not self._users
            if last:
                self._batcher = None
        if last and batcher is not None:
            batcher.close()

    def remove(self, name: str) -> int:
        """Lets an adapter go; returns how many adapters remain."""
        with self._lock:
            index = self.index.pop(name, None)
            for layer in self.module.modules():
                if isinstance(layer, LoraLinear):
                    layer.updates.pop(index, None)  # type: ignore[arg-type]
                elif isinstance(layer, SavedModule):
                    layer.copies.pop(index, None)  # type: ignore[arg-type]
            return len(self.index)

    @contextmanager
    def selecting(self, names: list[str | None]) -> Iterator[None]:
        """Each row of the pass in this block uses the adapter named for it (None: the base
        alone)."""
        device = next(self.module.parameters()).device
        positions: dict[int, list[int]] = {}
        for row, name in enumerate(names):
            if name in self.index:
                # None (the base alone), or an adapter unloaded under its request
                positions.setdefault(self.index[name], []).append(row)
        with self.pass_lock:
            self.groups = {
                index: torch.tensor(rows, device=device) for index, rows in positions.items()
            }
            try:
                yield
            finally:
                self.groups = {}

    @contextmanager
    def selecting_all(self, name: str) -> Iterator[None]:
        """Every row of the pass in this block uses ``name``'s adapter."""
        with self.pass_lock:
            self.groups = {self.index[name]: None} if name in self.index else {}
            try:
                yield
            finally:
                self.groups = {}

    def _wrapped(self, path: str, modules: dict[str, torch.nn.Module], kind: type[Any]) -> Any:
        layer = modules[path]
        if isinstance(layer, kind):
            return layer
        if kind is LoraLinear and not isinstance(layer, torch.nn.Linear):
            raise ModelLoadError(
                f"the adapter targets {path}, a {type(layer).__name__}: only Linear layers are "
                "served"
            )
        parent_path, _, child = path.rpartition(".")
        wrapper = kind(layer, self)
        setattr(modules[parent_path] if parent_path else self.module, child, wrapper)
        modules[path] = wrapper
        return wrapper


def _replaced(base: torch.nn.Module, state: dict[str, torch.Tensor], path: str) -> torch.nn.Module:
    """A copy of ``base`` holding the adapter's own state for it (same shapes, or the LOAD
    fails)."""
    replacement = copy.deepcopy(base)
    own = replacement.state_dict()
    for key, tensor in state.items():
        if key not in own or own[key].shape != tensor.shape:
            expected = tuple(own[key].shape) if key in own else "nothing"
            raise ModelLoadError(
                f"the adapter's {path}.{key} has shape {tuple(tensor.shape)}, the base's "
                f"{expected}: the base's config.json must describe the model the adapter was "
                "trained on (num_labels, for a head)",
                status=400,
            )
    replacement.load_state_dict(state, strict=False)
    return replacement


_SETS_LOCK = threading.Lock()


def attach(model: Any, module: torch.nn.Module, name: str, adapter: Adapter) -> AdapterSet:
    """Adds ``name``'s adapter to the adapter set of ``module`` (the base ``model`` holds), made on
    the first."""
    with _SETS_LOCK:
        adapters = getattr(model, "adapters", None)
        if adapters is None:
            adapters = AdapterSet(module)
            model.adapters = adapters
    adapters.add(name, adapter)
    return adapters

"""LoRA adapters served over one base module, row by row: ``attach`` adds an adapter (``lora.py`` read it) to its base
module's ``AdapterSet``. The base's target layers are wrapped once (``LoraLinear``, and ``SavedModule`` for a head
the adapter replaces) and hold every adapter's matrices; each row of a forward pass picks its own adapter
(``AdapterSet.selecting``), as Punica and S-LoRA do, so requests for different adapters share one pass over the base.
The answers equal PEFT's merged model for each adapter.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mme_runtime.base.errors import ModelLoadError
from mme_runtime.models.lora import Adapter


class LoraLinear(torch.nn.Module):
    """A base linear layer and the low-rank updates of the adapters that target it, picked row by row."""

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
    """A module some adapters replace whole (a classification head): each row goes through its adapter's copy."""

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
    """The adapters over one base module, and which adapter each row of the pass under way uses. One pass at a
    time: ``selecting`` holds a lock for the pass (the adapters' shared batcher runs one anyway)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.index: dict[str, int] = {}
        self.groups: dict[int, torch.Tensor | None] = {}  # adapter -> the rows of the pass that use it (None: all)
        self.pass_lock = threading.Lock()
        self._lock = threading.Lock()
        self._next = 0
        self._batcher: Any = None  # the one queue of every adapter's model (``serving/batcher.py``)
        self._users: set[str] = set()

    def add(self, name: str, adapter: Adapter) -> None:
        """Wraps the layers the adapter targets (once per layer) and gives them its tensors, on the module's device."""
        with self._lock:
            modules = dict(self.module.named_modules())
            missing = [path for path in (*adapter.lora, *adapter.saved) if path not in modules]
            if missing:
                names = ", ".join(missing[:5])
                raise ModelLoadError(f"the adapter targets modules the base does not have: {names}", status=400)
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
        """``name``'s model is unloaded: its adapter goes, and the shared batcher with the last of them."""
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
        """Each row of the pass in this block uses the adapter named for it (None: the base alone)."""
        device = next(self.module.parameters()).device
        positions: dict[int, list[int]] = {}
        for row, name in enumerate(names):
            if name in self.index:  # None (the base alone), or an adapter unloaded under its request
                positions.setdefault(self.index[name], []).append(row)
        with self.pass_lock:
            self.groups = {index: torch.tensor(rows, device=device) for index, rows in positions.items()}
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
            raise ModelLoadError(f"the adapter targets {path}, a {type(layer).__name__}: only Linear layers are served")
        parent_path, _, child = path.rpartition(".")
        wrapper = kind(layer, self)
        setattr(modules[parent_path] if parent_path else self.module, child, wrapper)
        modules[path] = wrapper
        return wrapper


def _replaced(base: torch.nn.Module, state: dict[str, torch.Tensor], path: str) -> torch.nn.Module:
    """A copy of ``base`` holding the adapter's own state for it (same shapes, or the LOAD fails)."""
    replacement = copy.deepcopy(base)
    own = replacement.state_dict()
    for key, tensor in state.items():
        if key not in own or own[key].shape != tensor.shape:
            expected = tuple(own[key].shape) if key in own else "nothing"
            raise ModelLoadError(
                f"the adapter's {path}.{key} has shape {tuple(tensor.shape)}, the base's {expected}: the base's "
                "config.json must describe the model the adapter was trained on (num_labels, for a head)",
                status=400,
            )
    replacement.load_state_dict(state, strict=False)
    return replacement


_SETS_LOCK = threading.Lock()


def attach(model: Any, module: torch.nn.Module, name: str, adapter: Adapter) -> AdapterSet:
    """Adds ``name``'s adapter to the adapter set of ``module`` (the base ``model`` holds), made on the first."""
    with _SETS_LOCK:
        adapters = getattr(model, "adapters", None)
        if adapters is None:
            adapters = AdapterSet(module)
            model.adapters = adapters
    adapters.add(name, adapter)
    return adapters

"""LoRA adapters served over one base module, row by row: each row of a pass uses its own adapter
(or none), so the rows of many adapters share the base's passes.

Each linear layer an adapter targets is wrapped once (``LoraLinear``). It holds the A and B matrices
of all its adapters concatenated along the rank (``Columns``), and a pass adds every row's update
in the gathered form Punica and S-LoRA use: ``x @ A.T`` over the columns of the adapters in the
pass, each row keeping only its own adapter's columns (a 0/1 mask), ``@ B.T``, times the row's
scaling. That is four tensor operations per layer whatever the number of adapters: no Python loop
over adapters inside a pass, and the shape a segmented GPU kernel can replace later. A row's
update is computed as PEFT computes it (``B(A(x)) * scaling``); the other adapters' columns add
exact zeros.

Which adapter each row uses is the calling thread's (``AdapterSet.using``): a batcher's pass, a
generation scheduler's step and a ``generate`` alone may run at once on one module. A ``Selection``
keeps what each layer derived from it (``Plan``), so that decoding steps over the same rows build
nothing. A module an adapter replaces whole (PEFT's ``modules_to_save``: a classification head,
an ``lm_head``) is chosen per row among copies (``SavedModule``).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from mme_runtime.base.errors import ModelLoadError
from mme_runtime.models.lora import Adapter

# A row with no adapter: the base alone.
NO_ADAPTER = -1
# The owner of a column an unloaded adapter left (no row's slot).
DEAD = -2
# The room a layer's buffers keep for more adapters' columns, as a share of what they hold: an
# adapter's LOAD copies ten adapters' columns on average, however many are loaded.
GROWTH = 1.1


@dataclass(frozen=True)
class Columns:
    """One layer's adapters, concatenated along the rank: ``down`` (rank x in) and ``up``
    (out x rank) hold every adapter's A and B, ``owner`` the adapter of each column (``DEAD``: an
    adapter unloaded left it), ``scaling`` each adapter's. Replaced whole when an adapter comes or
    goes, so a pass under way keeps its own; the buffers behind them keep room (``GROWTH``), so an
    adapter's LOAD writes its columns after the others' instead of copying them all."""

    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # down, up, owner, with room
    used: int  # the columns in use (an unloaded adapter's among them until they are compacted)
    scaling: dict[int, float]
    ranges: dict[int, tuple[int, int]]  # adapter -> its columns [first, end)

    @property
    def down(self) -> torch.Tensor:
        return self.buffers[0][: self.used]

    @property
    def up(self) -> torch.Tensor:
        return self.buffers[1][:, : self.used]

    @property
    def owner(self) -> torch.Tensor:  # (rank,), on the layer's device
        return self.buffers[2][: self.used]

    @staticmethod
    def adding(
        columns: Columns | None, index: int, down: torch.Tensor, up: torch.Tensor, scaling: float
    ) -> Columns:
        """``columns`` and adapter ``index``'s (A: rank x in, B: out x rank) after them: written
        in the room the buffers keep (which no snapshot reads), else in new buffers."""
        if columns is None or columns.used + down.shape[0] > columns.buffers[0].shape[0]:
            columns = _packed(columns, down.shape[0], down, up)
        first, end = columns.used, columns.used + down.shape[0]
        columns.buffers[0][first:end] = down
        columns.buffers[1][:, first:end] = up
        columns.buffers[2][first:end] = index
        scalings = {**columns.scaling, index: scaling}
        return Columns(columns.buffers, end, scalings, {**columns.ranges, index: (first, end)})

    def without(self, index: int) -> Columns | None:
        """These columns without adapter ``index``'s (None: no adapter left). Its columns are marked
        ``DEAD`` in place (its rows left the batch before); packed anew once a quarter is dead."""
        start, end = self.ranges[index]
        ranges = {other: span for other, span in self.ranges.items() if other != index}
        if not ranges:
            return None
        self.buffers[2][start:end] = DEAD
        scaling = {other: scale for other, scale in self.scaling.items() if other != index}
        left = Columns(self.buffers, self.used, scaling, ranges)
        live = sum(last - first for first, last in ranges.values())
        return _packed(left, 0) if 4 * (left.used - live) > left.used else left


def _packed(columns: Columns | None, more: int, *like: torch.Tensor) -> Columns:
    """New buffers holding ``columns``' live columns, in order, with room for ``more`` and a
    tenth more (``like``: the tensors whose shape, dtype and device they take when there are no
    columns yet)."""
    down, up = (columns.down, columns.up) if columns is not None else like
    ranges = {} if columns is None else dict(sorted(columns.ranges.items(), key=lambda r: r[1]))
    live = sum(end - start for start, end in ranges.values())
    capacity = max(live + more, int((live + more) * GROWTH))
    buffers = (
        down.new_empty((capacity, down.shape[1])),
        up.new_empty((up.shape[0], capacity)),
        torch.full((capacity,), DEAD, device=down.device),
    )
    moved, first = {}, 0
    for index, (start, end) in ranges.items():
        last = first + end - start
        buffers[0][first:last] = down[start:end]
        buffers[1][:, first:last] = up[:, start:end]
        buffers[2][first:last] = index
        moved[index], first = (first, last), last
    scaling = {} if columns is None else dict(columns.scaling)
    return Columns(buffers, first, scaling, moved)


@dataclass(frozen=True)
class Plan:
    """What one layer computes for one selection: its adapters' columns in the pass, each row's
    mask over them and each row's scaling (rows x 1 for a selection of one adapter for all)."""

    down: torch.Tensor
    up: torch.Tensor
    mask: torch.Tensor
    scale: torch.Tensor


@dataclass(eq=False)
class Selection:
    """The adapter of each row of a pass (``NO_ADAPTER``: the base alone); ``every`` when one
    adapter serves all rows, however many. Layers keep their plans for it here."""

    slots: list[int]
    every: bool = False
    plans: dict[int, tuple[Columns, Plan | None]] = field(default_factory=dict)
    _tensor: torch.Tensor | None = None
    _groups: dict[int, torch.Tensor | None] | None = None

    def tensor(self, device: torch.device) -> torch.Tensor:
        if self._tensor is None or self._tensor.device != device:
            self._tensor = torch.tensor(self.slots, device=device)
        return self._tensor

    def groups(self, device: torch.device) -> dict[int, torch.Tensor | None]:
        """Each adapter of the pass and its rows (None: all)."""
        if self._groups is None:
            if self.every:
                self._groups = {self.slots[0]: None}
            else:
                rows: dict[int, list[int]] = {}
                for row, slot in enumerate(self.slots):
                    if slot != NO_ADAPTER:
                        rows.setdefault(slot, []).append(row)
                self._groups = {
                    slot: torch.tensor(indices, device=device) for slot, indices in rows.items()
                }
        return self._groups


class _Wrapper(torch.nn.Module):
    """A layer that wraps ``base`` and reads as it does: a model may read its layers' attributes
    (T5's feed-forward casts to ``wo.weight.dtype``; ``vocabulary`` reads the embedding's size)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)


class LoraLinear(_Wrapper):
    """A base linear layer and the low-rank updates of the adapters that target it."""

    def __init__(self, base: torch.nn.Linear, adapters: AdapterSet) -> None:
        super().__init__()
        self.base = base
        self.adapters = adapters
        self.columns: Columns | None = None  # replaced whole when an adapter comes or goes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.base(x)
        selection, columns = self.adapters.current(), self.columns
        if selection is None or columns is None:
            return result
        plan = self._plan(selection, columns)
        if plan is None:
            return result
        rows = 1 if selection.every else len(selection.slots)
        if not selection.every and x.shape[0] != rows:
            raise RuntimeError(f"a pass of {x.shape[0]} rows selected adapters for {rows}")
        ones = (1,) * (x.dim() - 2)
        hidden = (x @ plan.down.T) * plan.mask.view(rows, *ones, -1)
        return result + (hidden @ plan.up.T) * plan.scale.view(rows, *ones, 1)

    def _plan(self, selection: Selection, columns: Columns) -> Plan | None:
        kept = selection.plans.get(id(self))
        if kept is not None and kept[0] is columns:
            return kept[1]
        plan = _plan(selection, columns)
        selection.plans[id(self)] = (columns, plan)
        return plan


def _plan(selection: Selection, columns: Columns) -> Plan | None:
    """The columns of the adapters in the pass (all of the layer's when they are at least half of
    them, else a copy of theirs), each row's mask over them and its scaling."""
    present = sorted(set(selection.slots) & columns.ranges.keys())
    if not present:
        return None
    down, up, owner = columns.down, columns.up, columns.owner
    if 2 * sum(columns.ranges[s][1] - columns.ranges[s][0] for s in present) < down.shape[0]:
        kept = torch.cat([torch.arange(*columns.ranges[slot]) for slot in present]).to(down.device)
        down, up, owner = down.index_select(0, kept), up.index_select(1, kept), owner[kept]
    slots = selection.tensor(down.device)
    mask = (slots[:, None] == owner[None, :]).to(down.dtype)
    scale = torch.tensor(
        [columns.scaling.get(slot, 0.0) for slot in selection.slots],
        dtype=down.dtype,
        device=down.device,
    )
    return Plan(down, up, mask, scale)


class SavedModule(_Wrapper):
    """A module some adapters replace whole (a classification head, an ``lm_head``): each row goes
    through its adapter's copy."""

    def __init__(self, base: torch.nn.Module, adapters: AdapterSet) -> None:
        super().__init__()
        self.base = base
        self.adapters = adapters
        self.copies: dict[int, torch.nn.Module] = {}

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result: torch.Tensor = self.base(x, *args, **kwargs)
        selection = self.adapters.current()
        if selection is None:
            return result
        for index, rows in selection.groups(x.device).items():
            own = self.copies.get(index)
            if own is None:
                continue
            if rows is None:
                result = own(x, *args, **kwargs)
            else:
                result.index_copy_(0, rows, own(x.index_select(0, rows), *args, **kwargs))
        return result


class AdapterSet:
    """The adapters over one base module, and the selection of rows each thread's pass uses."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.index: dict[str, int] = {}
        self._selected = threading.local()
        self._lock = threading.Lock()
        self._next = 0
        self.version = 0  # counts adapters come and gone: a selection made before names old slots
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
            for path, (down, up, _) in adapter.lora.items():
                _check_target(path, _unwrapped(modules[path]), down, up)
            copies = {
                path: _replaced(_unwrapped(modules[path]), state, path)
                for path, state in adapter.saved.items()
            }
            # all checked: a refused adapter leaves the base as it was, with no wrapper of its own
            layers = {path: self._wrapped(path, modules, LoraLinear) for path in adapter.lora}
            holders = {path: self._wrapped(path, modules, SavedModule) for path in adapter.saved}
            index, self._next = self._next, self._next + 1
            for path, layer in layers.items():
                down, up, scaling = adapter.lora[path]
                device, dtype = layer.base.weight.device, layer.base.weight.dtype
                own = (down.to(device, dtype), up.to(device, dtype), scaling)
                layer.columns = Columns.adding(layer.columns, index, *own)
            for path, holder in holders.items():
                holder.copies[index] = copies[path]
            self.index[name] = index
            self.version += 1

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
            if index is not None:
                self.version += 1
                for layer in self.module.modules():
                    if (
                        isinstance(layer, LoraLinear)
                        and layer.columns
                        and index in layer.columns.ranges
                    ):
                        layer.columns = layer.columns.without(index)
                    elif isinstance(layer, SavedModule):
                        layer.copies.pop(index, None)
            return len(self.index)

    def selection(self, names: list[str | None]) -> Selection | None:
        """The selection of rows that use the adapters named for them (None, or a name with no
        adapter here: the base alone); None when no row uses one."""
        slots = [self.index.get(name, NO_ADAPTER) if name else NO_ADAPTER for name in names]
        return None if all(slot == NO_ADAPTER for slot in slots) else Selection(slots)

    def current(self) -> Selection | None:
        selection: Selection | None = getattr(self._selected, "selection", None)
        return selection

    @contextmanager
    def using(self, selection: Selection | None) -> Iterator[None]:
        """The passes this thread runs in this block use ``selection``."""
        before = self.current()
        self._selected.selection = selection
        try:
            yield
        finally:
            self._selected.selection = before

    @contextmanager
    def selecting(self, names: list[str | None]) -> Iterator[None]:
        """Each row of the passes in this block uses the adapter named for it."""
        with self.using(self.selection(names)):
            yield

    @contextmanager
    def selecting_all(self, name: str) -> Iterator[None]:
        """Every row of the passes in this block uses ``name``'s adapter."""
        index = self.index.get(name)
        with self.using(None if index is None else Selection([index], every=True)):
            yield

    def _wrapped(self, path: str, modules: dict[str, torch.nn.Module], kind: type[Any]) -> Any:
        layer = modules[path]
        if isinstance(layer, kind):
            return layer
        parent_path, _, child = path.rpartition(".")
        wrapper = kind(layer, self)
        setattr(modules[parent_path] if parent_path else self.module, child, wrapper)
        modules[path] = wrapper
        return wrapper


def _unwrapped(layer: torch.nn.Module) -> torch.nn.Module:
    return layer.base if isinstance(layer, _Wrapper) else layer


def _check_target(path: str, layer: torch.nn.Module, down: torch.Tensor, up: torch.Tensor) -> None:
    """Refuses (400) an adapter's update of a layer that is not a Linear layer of its shapes."""
    if not isinstance(layer, torch.nn.Linear):
        raise ModelLoadError(
            f"the adapter targets {path}, a {type(layer).__name__}: only Linear layers are served",
            status=400,
        )
    weight = layer.weight
    if down.shape[1] != weight.shape[1] or up.shape[0] != weight.shape[0]:
        raise ModelLoadError(
            f"the adapter's {path} maps {down.shape[1]} to {up.shape[0]} features, the base's "
            f"{weight.shape[1]} to {weight.shape[0]}: it was trained on another base",
            status=400,
        )


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

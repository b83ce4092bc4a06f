"""A GPU host's tensors held once for every model that uses them: the tensors of two models whose bytes are one place
in host memory (``tensor_store.py`` made them so) become one tensor on the card.

``place`` puts a model's shared tensors on the device (a copy for the first model, the same storage for the others);
``place_model`` then moves the rest as always. Shared tensors are read-only: ``check_writes`` (after each forward
pass) finds a model that wrote to one in place, puts the weights back from host memory and fails that pass with a
clear error; a model that must write opts out with ``share_weights=false``. ``release`` (UNLOAD) frees a tensor once
its last model is gone. On the CPU there is nothing to do: the models' copy-on-write mappings of one file are one copy
until written. Runs in a device host, after it bound its GPU.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from mme_runtime.base.errors import ContainerError

Location = tuple[int, int]  # where the bytes are in host memory: (segment id, offset)


class SharedWeightWritten(ContainerError):
    """A model wrote in place to a tensor it shares with other models."""

    status = 500


@dataclass
class _Held:
    storage: torch.UntypedStorage  # on the device
    source: torch.UntypedStorage  # in host memory: what a write is undone from
    owners: set[str] = field(default_factory=set)


class DeviceTensors:
    """The shared tensors of one device host's models on its device, by their place in host memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._held: dict[Location, _Held] = {}
        self._watched: dict[str, list[tuple[torch.Tensor, int, Location]]] = {}  # owner -> (tensor, version, place)
        self._lock = threading.Lock()  # models load on threads of their own

    def new_bytes(self, places: list[tuple[Location, int]]) -> int:
        """What placing tensors at these places (with their sizes) would add to the device."""
        with self._lock:
            return sum(nbytes for place, nbytes in set(places) if place not in self._held)

    def place(self, module: torch.nn.Module, locations: dict[int, Location], owner: str) -> int:
        """Moves ``module``'s tensors whose storage came from a shared place onto the device (the one storage every
        model there uses); returns the bytes it found there already, held for another model (what its LOAD did not
        add). ``locations`` maps a host storage's address to its place (``model_package.unpack``)."""
        borrowed: dict[Location, int] = {}

        def move(tensor: torch.Tensor) -> torch.Tensor:
            place = locations.get(tensor.untyped_storage().data_ptr()) if tensor.device.type == "cpu" else None
            if place is None:
                return tensor
            held, found = self._hold(place, tensor.untyped_storage(), owner)
            if found:
                borrowed[place] = held.storage.nbytes()
            on_device = torch.empty(0, dtype=tensor.dtype, device=self.device)
            return on_device.set_(held.storage, tensor.storage_offset(), tensor.size(), tensor.stride())

        with torch.no_grad():
            module._apply(move)  # type: ignore[no-untyped-call]
        self._watch(module, owner)
        return sum(borrowed.values())

    def join(self, owner: str, places: list[Location]) -> None:
        """``owner`` uses the tensors already here at ``places`` too (the very model another one unpacked)."""
        with self._lock:
            for place in places:
                held = self._held.get(place)
                if held is not None:
                    held.owners.add(owner)

    def check_writes(self, owner: str) -> None:
        """Raises ``SharedWeightWritten`` (and undoes the write) when ``owner`` wrote in place to a shared tensor."""
        watched = self._watched.get(owner, [])
        changed = [place for tensor, version, place in watched if tensor._version != version]
        if not changed:
            return
        written = []
        with torch.no_grad(), self._lock:
            for place in changed:
                held = self._held.get(place)
                if held is not None and len(held.owners) > 1:
                    held.storage.copy_(held.source)
                    written.append(place)
                elif held is not None:  # its own alone: it keeps its change, and a later model gets a fresh copy
                    del self._held[place]
        self._watched[owner] = [(tensor, tensor._version, place) for tensor, _, place in watched if place in self._held]
        if not written:
            return
        raise SharedWeightWritten(
            f"model {owner} wrote in place to {len(written)} weight tensor(s) it shares with other models; they were "
            "put back and this request failed. Set share_weights=false in its serving.properties if it must write "
            "to its weights"
        )

    def release(self, owner: str) -> None:
        """``owner`` is unloaded: the tensors no other model uses leave the device."""
        with self._lock:
            self._watched.pop(owner, None)
            for place, held in list(self._held.items()):
                held.owners.discard(owner)
                if not held.owners:
                    del self._held[place]

    def _hold(self, place: Location, source: torch.UntypedStorage, owner: str) -> tuple[_Held, bool]:
        """The device's tensor for ``place`` (made now from ``source`` if there is none), and whether another model
        had it there already."""
        with self._lock:
            held = self._held.get(place)
            found = held is not None and bool(held.owners - {owner})
            if held is None:
                held = self._held[place] = _Held(_to_device(source, self.device), source)
            held.owners.add(owner)
            return held, found

    def _watch(self, module: torch.nn.Module, owner: str) -> None:
        """Notes the version of each shared tensor of the module: a write in place raises it."""
        with self._lock:
            places = {held.storage.data_ptr(): place for place, held in self._held.items() if owner in held.owners}
        self._watched[owner] = [
            (tensor, tensor._version, places[pointer])
            for tensor in (*module.parameters(), *module.buffers())
            if (pointer := tensor.untyped_storage().data_ptr()) in places
        ]


def _to_device(source: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
    """A copy of ``source`` on ``device`` (a copy even on the CPU: what the tests use to run this module's code)."""
    copy = torch.empty(source.nbytes(), dtype=torch.uint8, device=device)
    copy.copy_(torch.empty(0, dtype=torch.uint8).set_(source))
    return copy.untyped_storage()


def module_of(model: Any) -> torch.nn.Module | None:
    """The module whose tensors a model's placement moves (a Hugging Face model's own module), if any."""
    inner = getattr(model, "model", None)
    if isinstance(model, torch.nn.Module):
        return model
    return inner if isinstance(inner, torch.nn.Module) else None

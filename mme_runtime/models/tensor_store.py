"""Tensors held once by content: in the warm process's shared-memory files, and on each GPU's card.

A package arrives from its loader with the digest of each storage (``model_package.py``).
``TensorStore.add`` points each blob whose digest is known, and whose bytes really are equal
(compared, never assumed from the digest), at the copy already held, and gives the duplicate's pages
back to the system (a hole punched in the new file). Each place a blob lives is counted by the
packages that use it: ``release`` (UNLOAD) punches out what no package uses any more and closes a
file once nothing in it is used, so no model loses a tensor another still needs. Never touches CUDA.

On a GPU, ``DeviceTensors`` (a device host's) makes the tensors of two models whose bytes are one
place in host memory one tensor on the card, refuses in-place writes to such a tensor, and frees it
with its last model.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from mme_runtime.base.errors import ContainerError
from mme_runtime.models.model_package import OWN_PAGES_BYTES, PAGE, Blob, Package

logger = logging.getLogger(__name__)

# A smaller blob shares its page with others (``model_package.py``): it is kept where it is (bytes,
# per model).
MIN_SHARED_BYTES = OWN_PAGES_BYTES
# Descriptors one message may carry to a device host (SCM_RIGHTS takes 253): a package uses at most
# this many files.
MAX_SEGMENTS = 200
_FALLOC_FL_KEEP_SIZE = 1
_FALLOC_FL_PUNCH_HOLE = 2

Location = tuple[int, int]  # where bytes are held in host memory: (segment id, offset)


@dataclass
class _Segment:
    """One package's file: alive while its package is, or while another package uses a blob in
    it."""

    fd: int
    owned: bool = True  # its own package is still loaded
    # offset -> digest, for what the index points at here
    digests: dict[int, str] = field(default_factory=dict)


class TensorStore:
    """Every package of the warm process, and the blobs they hold, counted by place."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.segments: dict[int, _Segment] = {}
        self.uses: Counter[Location] = Counter()  # packages that use each place
        self.sizes: dict[Location, int] = {}
        self.index: dict[str, Location] = {}  # digest -> the place its bytes are held
        self._next_id = 1

    def add(self, package: Package, share: bool = True) -> Package:
        """Takes ``package`` (its own file now belongs to the store) and returns it with every blob
        that equals one already held pointing there. ``share=False`` (the model opted out): its
        blobs stay its own, unshared."""
        segment_id, self._next_id = self._next_id, self._next_id + 1
        own = self.segments[segment_id] = _Segment(package.fd)
        ids = [segment_id]
        blobs: list[Blob] = []
        # a place this package uses already: two of its storages must not become one
        taken: set[Location] = set()
        for blob in package.blobs:
            place = self._equal_held(blob, package.fd) if share and self.enabled else None
            if (
                place is not None
                and place not in taken
                and (place[0] in ids or len(ids) < MAX_SEGMENTS)
            ):
                if place[0] not in ids:
                    ids.append(place[0])
                blobs.append(Blob(ids.index(place[0]), place[1], blob.nbytes, blob.digest))
                _punch(package.fd, blob.offset, blob.nbytes)  # the loader's duplicate goes
            else:
                place = (segment_id, blob.offset)
                blobs.append(replace(blob, segment=0))
                if share and self.enabled and blob.digest and blob.nbytes >= MIN_SHARED_BYTES:
                    self.index.setdefault(blob.digest, place)
                    own.digests[blob.offset] = blob.digest
            taken.add(place)
            self.uses[place] += 1
            self.sizes[place] = blob.nbytes
        shared = sum(blob.nbytes for blob in blobs if blob.segment)
        if shared:
            logger.info(
                "%d of %d tensor bytes are held once for several models",
                shared,
                self.bytes_of(blobs),
            )
        segments = tuple(self.segments[i].fd for i in ids[1:])
        return replace(package, blobs=tuple(blobs), segments=segments, segment_ids=tuple(ids))

    def release(self, package: Package) -> None:
        """The package is unloaded: what no other package uses goes back to the system."""
        ids = package.segment_ids
        if not ids:  # never added (closed where it was made)
            package.close()
            return
        unused: list[tuple[Location, int]] = []
        for blob in package.blobs:
            place = (ids[blob.segment], blob.offset)
            self.uses[place] -= 1
            if self.uses[place] <= 0:
                unused.append((place, self._forget(place)))
        self.segments[ids[0]].owned = False
        unused.append(((ids[0], package.pickle_offset), package.pickle_bytes))
        closing = {segment_id for segment_id in ids if self._unused(segment_id)}
        for (segment_id, offset), nbytes in unused:
            # a file that stays for others' tensors gives these pages back
            if segment_id not in closing:
                _punch(self.segments[segment_id].fd, offset, nbytes)
        for segment_id in closing:  # the rest goes whole (punching it first would only cost time)
            os.close(self.segments.pop(segment_id).fd)

    def bytes_of(self, blobs: list[Blob] | tuple[Blob, ...]) -> int:
        return sum(blob.nbytes for blob in blobs)

    def shared_bytes(self, package: Package) -> int:
        """The bytes of the package's blobs that another package uses too (each such tensor counted
        here once)."""
        ids = package.segment_ids
        return sum(
            blob.nbytes
            for blob in package.blobs
            if ids and self.uses[(ids[blob.segment], blob.offset)] > 1
        )

    def _equal_held(self, blob: Blob, fd: int) -> Location | None:
        """Where a blob of equal bytes is held already; None when none is (or the digest lied:
        compared byte for byte, so a crafted collision gets its own copy)."""
        if not blob.digest or blob.nbytes < MIN_SHARED_BYTES:
            return None
        place = self.index.get(blob.digest)
        if place is None or self.sizes.get(place) != blob.nbytes:
            return None
        return (
            place
            if _same_bytes(self.segments[place[0]].fd, place[1], fd, blob.offset, blob.nbytes)
            else None
        )

    def _forget(self, place: Location) -> int:
        """No package uses this place any more: it leaves the index. Returns its size."""
        del self.uses[place]
        nbytes = self.sizes.pop(place)
        segment = self.segments.get(place[0])
        digest = None if segment is None else segment.digests.pop(place[1], None)
        if digest is not None and self.index.get(digest) == place:
            del self.index[digest]
        return nbytes

    def _unused(self, segment_id: int) -> bool:
        """Whether a file can go: its package is unloaded and no other package uses a tensor in
        it."""
        segment = self.segments.get(segment_id)
        return (
            segment is not None
            and not segment.owned
            and not any(p[0] == segment_id for p in self.uses)
        )


def _same_bytes(fd_a: int, offset_a: int, fd_b: int, offset_b: int, nbytes: int) -> bool:
    """Whether two files hold the same bytes at these offsets (memcmp over read-only mappings,
    unmapped after)."""
    start_a, start_b = offset_a - offset_a % PAGE, offset_b - offset_b % PAGE
    with (
        mmap.mmap(
            fd_a, offset_a - start_a + nbytes, mmap.MAP_SHARED, mmap.PROT_READ, offset=start_a
        ) as a,
        mmap.mmap(
            fd_b, offset_b - start_b + nbytes, mmap.MAP_SHARED, mmap.PROT_READ, offset=start_b
        ) as b,
    ):
        view_a = np.frombuffer(a, np.uint8, nbytes, offset_a - start_a)
        view_b = np.frombuffer(b, np.uint8, nbytes, offset_b - start_b)
        equal = bool(_memcmp(view_a.ctypes.data, view_b.ctypes.data, nbytes) == 0)
        del view_a, view_b  # the mappings close only once no array points into them
    return equal


def _punch(fd: int, offset: int, nbytes: int) -> None:
    """Gives the pages of ``[offset, offset + nbytes)`` back to the system; the file keeps its size.
    Only for what ``model_package`` packed on pages of its own (a blob of a page or more, or the
    pickle, last in its file)."""
    if offset % PAGE or nbytes < MIN_SHARED_BYTES:
        return
    start, end = offset, -(-(offset + nbytes) // PAGE) * PAGE
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    if _libc.fallocate(fd, mode, start, end - start) != 0:
        error = ctypes.get_errno()
        logger.warning(
            "could not give back %d bytes of a model file: %s", end - start, os.strerror(error)
        )


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.fallocate.restype = ctypes.c_int
_memcmp = _libc.memcmp
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_memcmp.restype = ctypes.c_int


class SharedWeightWritten(ContainerError):
    """A model wrote in place to a tensor it shares with other models."""

    status = 500


@dataclass
class _Held:
    storage: torch.UntypedStorage  # on the device
    source: torch.UntypedStorage  # in host memory: what a write is undone from
    owners: set[str] = field(default_factory=set)


class DeviceTensors:
    """The shared tensors of one device host's models on its device, by their place in host
    memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._held: dict[Location, _Held] = {}
        # owner -> (tensor, version, place)
        self._watched: dict[str, list[tuple[torch.Tensor, int, Location]]] = {}
        self._lock = threading.Lock()  # models load on threads of their own

    def new_bytes(self, places: list[tuple[Location, int]]) -> int:
        """What placing tensors at these places (with their sizes) would add to the device."""
        with self._lock:
            return sum(nbytes for place, nbytes in set(places) if place not in self._held)

    def place(self, module: torch.nn.Module, locations: dict[int, Location], owner: str) -> int:
        """Moves ``module``'s tensors whose storage came from a shared place onto the device (the
        one storage every model there uses); returns the bytes it found there already, held for
        another model (what its LOAD did not add). ``locations`` maps a host storage's address to
        its place (``model_package.unpack``)."""
        borrowed: dict[Location, int] = {}

        def move(tensor: torch.Tensor) -> torch.Tensor:
            place = (
                locations.get(tensor.untyped_storage().data_ptr())
                if tensor.device.type == "cpu"
                else None
            )
            if place is None:
                return tensor
            held, found = self._hold(place, tensor.untyped_storage(), owner)
            if found:
                borrowed[place] = held.storage.nbytes()
            on_device = torch.empty(0, dtype=tensor.dtype, device=self.device)
            return on_device.set_(
                held.storage, tensor.storage_offset(), tensor.size(), tensor.stride()
            )

        with torch.no_grad():
            module._apply(move)  # type: ignore[no-untyped-call]
        self._watch(module, owner)
        return sum(borrowed.values())

    def join(self, owner: str, places: list[Location]) -> None:
        """``owner`` uses the tensors already here at ``places`` too (the very model another one
        unpacked)."""
        with self._lock:
            for place in places:
                held = self._held.get(place)
                if held is not None:
                    held.owners.add(owner)

    def check_writes(self, owner: str) -> None:
        """Raises ``SharedWeightWritten`` (and undoes the write) when ``owner`` wrote in place to a
        shared tensor."""
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
                elif held is not None:
                    # its own alone: it keeps its change, and a later model gets a fresh copy
                    del self._held[place]
        self._watched[owner] = [
            (tensor, tensor._version, place) for tensor, _, place in watched if place in self._held
        ]
        if not written:
            return
        raise SharedWeightWritten(
            f"model {owner} wrote in place to {len(written)} weight tensor(s) it shares with other "
            "models; they were put back and this request failed. Set share_weights=false in its "
            "serving.properties if it must write to its weights"
        )

    def release(self, owner: str) -> None:
        """``owner`` is unloaded: the tensors no other model uses leave the device."""
        with self._lock:
            self._watched.pop(owner, None)
            for place, held in list(self._held.items()):
                held.owners.discard(owner)
                if not held.owners:
                    del self._held[place]

    def _hold(
        self, place: Location, source: torch.UntypedStorage, owner: str
    ) -> tuple[_Held, bool]:
        """The device's tensor for ``place`` (made now from ``source`` if there is none), and
        whether another model had it there already."""
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
            places = {
                held.storage.data_ptr(): place
                for place, held in self._held.items()
                if owner in held.owners
            }
        self._watched[owner] = [
            (tensor, tensor._version, places[pointer])
            for tensor in (*module.parameters(), *module.buffers())
            if (pointer := tensor.untyped_storage().data_ptr()) in places
        ]


def _to_device(source: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
    """A copy of ``source`` on ``device`` (a copy even on the CPU: what the tests use to run this
    module's code)."""
    copy = torch.empty(source.nbytes(), dtype=torch.uint8, device=device)
    copy.copy_(torch.empty(0, dtype=torch.uint8).set_(source))
    return copy.untyped_storage()


def module_of(model: Any) -> torch.nn.Module | None:
    """The module whose tensors a model's placement moves (a Hugging Face model's own module), if
    any."""
    inner = getattr(model, "model", None)
    if isinstance(model, torch.nn.Module):
        return model
    return inner if isinstance(inner, torch.nn.Module) else None


def tensor_bytes(model: Any) -> tuple[int, int]:
    """The bytes of a module's parameters and buffers in host memory and on a GPU, each storage once
    (tied weights share one); (0, 0) for what is not a module."""
    if not isinstance(model, torch.nn.Module):
        return 0, 0
    seen: set[int] = set()
    host = device = 0
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        if tensor.device.type == "cpu":
            host += storage.nbytes()
        else:
            device += storage.nbytes()
    return host, device

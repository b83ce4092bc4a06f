"""A loaded model turned into bytes and one shared-memory file, so that a device host can take it
without running ``model_fn`` again: the preload runs once in a CUDA-free loader, the host maps the
weights.

``pack`` pickles what ``model_fn`` returned with every tensor storage written once into a ``memfd``
(tied weights stay tied), each a ``Blob`` with the digest of its bytes, and every TorchScript module
saved whole (TorchScript objects do not pickle). The pickle names blobs by their index in the
package's table, so the warm process can point a blob at an equal one another package holds
(``tensor_store.py``) without touching the pickle. ``unpack`` maps the files copy-on-write: on the
CPU the host's tensors are the files' pages, with no copy; placing the model on a GPU copies them
there. The warm process keeps the files, so a replaced host maps the same weights again. Never
touches CUDA.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import xxhash

ALIGNMENT = 64
PAGE = mmap.PAGESIZE
# A storage of at least this many bytes starts on a page and ends its pages alone, so that its pages
# can be given back on their own (a hole punched in the file) once no model uses them: a LayerNorm's
# 3 KiB too, at the price of a page. Smaller ones (a bias of a few classes) are packed at ALIGNMENT,
# never shared: padding them would cost more.
OWN_PAGES_BYTES = 1024
# started on first use: a loader's, never the warm one
_hashing = ThreadPoolExecutor(1, thread_name_prefix="mme-hash")
# A storage this large is hashed on that thread while the packer goes on; a smaller one right away
# (xxh3 takes about 30 us for 1 MiB, less than handing it over).
HASHED_ASIDE_BYTES = 1 << 20
PROTOCOL = 5
_FILE = object()  # stands for a TorchScript archive packed as it is


class NotPackable(Exception):
    """The model cannot leave the process that loaded it (the reason is the message)."""


@dataclass(frozen=True)
class Blob:
    """One tensor storage of a package: its bytes at ``offset`` in the package's segment number
    ``segment`` (0: the package's own file), and the digest of their content ("" when it was not
    hashed)."""

    segment: int
    offset: int
    nbytes: int
    digest: str = ""


@dataclass(frozen=True)
class Package:
    """A packed model: its own shared-memory file (``fd``, owned by whoever holds the package) with
    the weights first and the pickle at ``pickle_offset``, and the table of its tensor storages
    (``blobs``). Blobs that equal another package's point into that package's file: ``segments``
    holds those files' descriptors (the tensor store's, not the package's) and ``segment_ids`` names
    every file the blobs use, its own first. ``layout`` is what travels beside the descriptors
    (``fds``)."""

    fd: int
    pickle_offset: int
    pickle_bytes: int
    blobs: tuple[Blob, ...] = ()
    segments: tuple[int, ...] = ()
    segment_ids: tuple[int, ...] = ()
    # the inference code directory model_fn ran with (a fetched one is named by its ETag)
    code: str | None = None

    @property
    def fds(self) -> list[int]:
        return [self.fd, *self.segments]

    @property
    def layout(self) -> dict[str, Any]:
        return {
            "pickle_offset": self.pickle_offset,
            "pickle_bytes": self.pickle_bytes,
            "blobs": [[blob.segment, blob.offset, blob.nbytes, blob.digest] for blob in self.blobs],
            "segment_ids": list(self.segment_ids),
            "code": self.code,
        }

    @classmethod
    def from_layout(cls, fds: list[int], layout: dict[str, Any]) -> Package:
        """The package a ``layout`` and its descriptors (``fds``, its own file first) describe."""
        blobs = tuple(Blob(*entry) for entry in layout.get("blobs", ()))
        ids = tuple(layout.get("segment_ids", ()))
        offset, size, code = layout["pickle_offset"], layout["pickle_bytes"], layout.get("code")
        return cls(fds[0], offset, size, blobs, tuple(fds[1:]), ids, code)

    def close(self) -> None:
        os.close(self.fd)


class _Writer:
    """Appends blobs to the memfd at aligned offsets; a storage seen twice is written once."""

    def __init__(self, name: str, hashed: bool = True) -> None:
        self.fd = os.memfd_create(f"mme-model-{name}"[:200], os.MFD_CLOEXEC)
        self.size = 0
        self.hashed = hashed
        self.blobs: list[Blob] = []
        self._storages: dict[tuple[int, int], int] = {}  # (address, bytes) -> index in blobs
        # blob index -> its digest, still being taken aside
        self._digests: dict[int, Future[str]] = {}

    def append(self, data: memoryview | bytes) -> int:
        view = memoryview(data).cast("B")
        alignment = PAGE if len(view) >= OWN_PAGES_BYTES else ALIGNMENT
        offset = -(-self.size // alignment) * alignment
        written = 0
        while written < len(view):
            written += os.pwrite(self.fd, view[written:], offset + written)
        self.size = offset + len(view)
        if alignment == PAGE:
            self.size = -(-self.size // PAGE) * PAGE  # its last page holds nothing else
        return offset

    def append_file(self, path: Path) -> tuple[int, int]:
        """``path``'s bytes, copied by the kernel; returns their offset and size."""
        offset = -(-self.size // ALIGNMENT) * ALIGNMENT
        size = path.stat().st_size
        os.lseek(self.fd, offset, os.SEEK_SET)  # sendfile writes at the file's position
        copied = 0
        with path.open("rb") as source:
            while copied < size and (
                sent := os.sendfile(self.fd, source.fileno(), copied, size - copied)
            ):
                copied += sent
        self.size = offset + copied
        return offset, copied

    def storage(self, storage: torch.UntypedStorage) -> int:
        """The storage's index in the blob table, written (and hashed) the first time it is seen."""
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self._storages:
            if storage.device.type != "cpu":
                raise NotPackable(
                    f"a tensor is on {storage.device}: model_fn must leave the model in host memory"
                )
            array: Any = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()  # a view, no copy
            index, digest = len(self.blobs), ""
            if self.hashed and array.nbytes >= HASHED_ASIDE_BYTES:
                # Hashed on another core while this one packs on (both release the GIL): it costs no
                # extra time.
                self._digests[index] = _hashing.submit(xxhash.xxh3_128_hexdigest, array)
            elif self.hashed and array.nbytes:
                digest = xxhash.xxh3_128_hexdigest(array)
            offset = self.append(memoryview(array))
            self._storages[key] = index
            self.blobs.append(Blob(0, offset, array.nbytes, digest))
        return self._storages[key]

    def finished_blobs(self) -> tuple[Blob, ...]:
        """Every blob, with the digests taken aside."""
        for index, digest in self._digests.items():
            self.blobs[index] = replace(self.blobs[index], digest=digest.result())
        self._digests.clear()
        return tuple(self.blobs)


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, writer: _Writer) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self.writer = writer

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            untyped = obj._untyped_storage
            return ("blob", self.writer.storage(untyped), str(obj.dtype).removeprefix("torch."))
        if isinstance(obj, torch.UntypedStorage):
            return ("blob", self.writer.storage(obj), "uint8")
        if isinstance(obj, torch.jit.ScriptModule):
            buffer = io.BytesIO()
            torch.jit.save(obj, buffer)
            saved = buffer.getbuffer()
            return ("torchscript", self.writer.append(saved), saved.nbytes)
        return None


def pack_torchscript_file(path: Path, name: str) -> Package:
    """A TorchScript archive as it is on disk: what ``torch.jit.save`` would write again, when the
    default ``model_fn`` would only load it (its bytes reach the host with no load and save
    here)."""
    writer = _Writer(name)
    offset, size = writer.append_file(path)
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=PROTOCOL)
    pickler.persistent_id = lambda obj: ("torchscript", offset, size) if obj is _FILE else None  # type: ignore[method-assign]
    pickler.dump(_FILE)
    pickle_offset = writer.append(buffer.getbuffer())
    return Package(writer.fd, pickle_offset, buffer.getbuffer().nbytes)


# where a model directory holds its TorchScript (or a state dict)
MODEL_FILES = ("model.pt", "model.pth")


def model_file(model_dir: Path) -> Path | None:
    """The model directory's ``model.pt`` or ``model.pth``, if it has one."""
    return next((model_dir / name for name in MODEL_FILES if (model_dir / name).is_file()), None)


def is_torchscript(path: Path) -> bool:
    """Whether ``path`` is a TorchScript archive (``torch.jit.save``: code and constants beside the
    data), not a ``torch.save`` checkpoint; read from the zip's directory only."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return False
    return any(name.endswith("/constants.pkl") for name in names) and any(
        "/code/" in name for name in names
    )


def pack(model: Any, name: str, hashed: bool = True) -> Package:
    """``model`` as a package; ``NotPackable`` with the reason when it cannot be pickled (a lambda,
    a lock, an open file or a GPU tensor in it). ``hashed``: each storage's digest taken (what
    sharing weights needs)."""
    writer = _Writer(name, hashed)
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, writer).dump(model)
    except NotPackable:
        os.close(writer.fd)
        raise
    except Exception as exc:  # noqa: BLE001 - pickle raises many types for objects it cannot handle
        os.close(writer.fd)
        raise NotPackable(
            f"{type(model).__name__} cannot be pickled: {type(exc).__name__}: {exc}"
        ) from exc
    offset = writer.append(buffer.getbuffer())
    return Package(writer.fd, offset, buffer.getbuffer().nbytes, writer.finished_blobs())


class _Unpickler(pickle.Unpickler):
    def __init__(
        self, file: io.BytesIO, package: Package, maps: list[mmap.mmap], trial: bool
    ) -> None:
        super().__init__(file)
        self.package = package
        self.maps = maps
        # TorchScript saved whole loads again: a trial skips it (its one costly part)
        self.trial = trial
        self.storages: dict[int, torch.UntypedStorage] = {}  # by blob index

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "blob":
            _, index, dtype = pid
            return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
                wrap_storage=self._untyped(index), dtype=getattr(torch, dtype), _internal=True
            )
        if kind == "torchscript":
            _, offset, nbytes = pid
            if self.trial:
                return None
            return torch.jit.load(
                io.BytesIO(self.maps[0][offset : offset + nbytes]), map_location="cpu"
            )  # type: ignore[no-untyped-call]
        raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")

    def _untyped(self, index: int) -> torch.UntypedStorage:
        if index not in self.storages:
            blob = self.package.blobs[index]
            if blob.nbytes == 0:
                self.storages[index] = torch.UntypedStorage(0)  # type: ignore[no-untyped-call]
            else:
                # Shares the mapping's pages (frombuffer keeps the mapping alive as long as the
                # storage lives).
                data = self.maps[blob.segment]
                view = torch.frombuffer(
                    data, dtype=torch.uint8, count=blob.nbytes, offset=blob.offset
                )
                self.storages[index] = view.untyped_storage()
        return self.storages[index]


@dataclass
class Unpacked:
    """An unpacked model, and where each of its storages came from: ``locations`` maps a storage's
    address to its blob's place (segment id, offset), what equal tensors of two models have in
    common (``tensor_store.py``)."""

    model: Any
    locations: dict[int, tuple[int, int]]


def unpack(package: Package, trial: bool = False) -> Unpacked:
    """The model, its weights mapped copy-on-write from the package's files (the caller keeps or
    closes the descriptors: the mappings do not need them). Each call maps the files anew, so a
    write by one model's tensors stays in that model. The model's classes must be importable here:
    the host imports the model's script under the same unique module name first. ``trial``: only
    whether it unpacks (what pickles may still not unpickle: an exported program's module does not),
    its TorchScript modules not loaded."""
    maps = [mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_PRIVATE) for fd in package.fds]
    own = maps[0]
    pickled = bytes(own[package.pickle_offset : package.pickle_offset + package.pickle_bytes])
    unpickler = _Unpickler(io.BytesIO(pickled), package, maps, trial)
    model = unpickler.load()
    ids = package.segment_ids
    locations = {
        storage.data_ptr(): (ids[package.blobs[index].segment], package.blobs[index].offset)
        for index, storage in unpickler.storages.items()
        if ids and storage.nbytes()
    }
    return Unpacked(model, locations)

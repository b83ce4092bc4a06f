"""A loaded model turned into bytes and one shared-memory file, so that a device host can take it without running
``model_fn`` again: the preload runs once in a CUDA-free loader, the host maps the weights.

``pack`` pickles what ``model_fn`` returned with every tensor storage written once into a ``memfd`` (tied weights stay
tied) and every TorchScript module saved whole (TorchScript objects do not pickle). ``unpack`` maps that file
copy-on-write: on the CPU the host's tensors are the file's pages, with no copy; placing the model on a GPU copies
them there. The warm process keeps the file, so a replaced host maps the same weights again. Never touches CUDA.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ALIGNMENT = 64
PROTOCOL = 5
_FILE = object()  # stands for a TorchScript archive packed as it is


class NotPackable(Exception):
    """The model cannot leave the process that loaded it (the reason is the message)."""


@dataclass(frozen=True)
class Package:
    """A packed model: one shared-memory file (``fd``, owned by whoever holds the package) with the weights first and
    the pickle at ``pickle_offset``. ``layout`` is what travels beside the descriptor."""

    fd: int
    pickle_offset: int
    pickle_bytes: int

    @property
    def layout(self) -> dict[str, int]:
        return {"pickle_offset": self.pickle_offset, "pickle_bytes": self.pickle_bytes}

    def close(self) -> None:
        os.close(self.fd)


class _Writer:
    """Appends blobs to the memfd at aligned offsets; a storage seen twice is written once."""

    def __init__(self, name: str) -> None:
        self.fd = os.memfd_create(f"mme-model-{name}"[:200], os.MFD_CLOEXEC)
        self.size = 0
        self._storages: dict[tuple[int, int], int] = {}

    def append(self, data: memoryview | bytes) -> int:
        offset = -(-self.size // ALIGNMENT) * ALIGNMENT
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += os.pwrite(self.fd, view[written:], offset + written)
        self.size = offset + len(view)
        return offset

    def append_file(self, path: Path) -> tuple[int, int]:
        """``path``'s bytes, copied by the kernel; returns their offset and size."""
        offset = -(-self.size // ALIGNMENT) * ALIGNMENT
        size = path.stat().st_size
        os.lseek(self.fd, offset, os.SEEK_SET)  # sendfile writes at the file's position
        copied = 0
        with path.open("rb") as source:
            while copied < size and (sent := os.sendfile(self.fd, source.fileno(), copied, size - copied)):
                copied += sent
        self.size = offset + copied
        return offset, copied

    def storage(self, storage: torch.UntypedStorage) -> int:
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self._storages:
            if storage.device.type != "cpu":
                raise NotPackable(f"a tensor is on {storage.device}: model_fn must leave the model in host memory")
            array: Any = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()  # a view, no copy
            self._storages[key] = self.append(memoryview(array))
        return self._storages[key]


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, writer: _Writer) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self.writer = writer

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            untyped = obj._untyped_storage
            return ("storage", self.writer.storage(untyped), untyped.nbytes(), str(obj.dtype).removeprefix("torch."))
        if isinstance(obj, torch.UntypedStorage):
            return ("storage", self.writer.storage(obj), obj.nbytes(), "uint8")
        if isinstance(obj, torch.jit.ScriptModule):
            buffer = io.BytesIO()
            torch.jit.save(obj, buffer)
            saved = buffer.getbuffer()
            return ("torchscript", self.writer.append(saved), saved.nbytes)
        return None


def pack_torchscript_file(path: Path, name: str) -> Package:
    """A TorchScript archive as it is on disk: what ``torch.jit.save`` would write again, when the default
    ``model_fn`` would only load it (its bytes reach the host with no load and save here)."""
    writer = _Writer(name)
    offset, size = writer.append_file(path)
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=PROTOCOL)
    pickler.persistent_id = lambda obj: ("torchscript", offset, size) if obj is _FILE else None  # type: ignore[method-assign]
    pickler.dump(_FILE)
    pickle_offset = writer.append(buffer.getbuffer())
    return Package(writer.fd, pickle_offset, writer.size - pickle_offset)


def is_torchscript(path: Path) -> bool:
    """Whether ``path`` is a TorchScript archive (``torch.jit.save``: code and constants beside the data), not a
    ``torch.save`` checkpoint; read from the zip's directory only."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return False
    return any(name.endswith("/constants.pkl") for name in names) and any("/code/" in name for name in names)


def pack(model: Any, name: str) -> Package:
    """``model`` as a package; ``NotPackable`` with the reason when it cannot be pickled (a lambda, a lock, an open
    file or a GPU tensor in it)."""
    writer = _Writer(name)
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, writer).dump(model)
    except NotPackable:
        os.close(writer.fd)
        raise
    except Exception as exc:  # noqa: BLE001 - pickle raises many types for objects it cannot handle
        os.close(writer.fd)
        raise NotPackable(f"{type(model).__name__} cannot be pickled: {type(exc).__name__}: {exc}") from exc
    offset = writer.append(buffer.getbuffer())
    return Package(writer.fd, offset, writer.size - offset)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, data: mmap.mmap, trial: bool = False) -> None:
        super().__init__(file)
        self.data = data
        self.trial = trial  # TorchScript saved whole loads again: a trial skips it (its one costly part)
        self._storages: dict[int, torch.UntypedStorage] = {}

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "storage":
            _, offset, nbytes, dtype = pid
            untyped = self._untyped(offset, nbytes)
            return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
                wrap_storage=untyped, dtype=getattr(torch, dtype), _internal=True
            )
        if kind == "torchscript":
            _, offset, nbytes = pid
            if self.trial:
                return None
            return torch.jit.load(io.BytesIO(self.data[offset : offset + nbytes]), map_location="cpu")  # type: ignore[no-untyped-call]
        raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")

    def _untyped(self, offset: int, nbytes: int) -> torch.UntypedStorage:
        if nbytes == 0:
            return torch.UntypedStorage(0)  # type: ignore[no-untyped-call]
        if offset not in self._storages:
            # Shares the mapping's pages (frombuffer keeps the mapping alive as long as the storage lives).
            view = torch.frombuffer(self.data, dtype=torch.uint8, count=nbytes, offset=offset)
            self._storages[offset] = view.untyped_storage()
        return self._storages[offset]


def unpack(fd: int, pickle_offset: int, pickle_bytes: int, trial: bool = False) -> Any:
    """The model, its weights mapped copy-on-write from ``fd`` (the caller keeps or closes the descriptor: the mapping
    does not need it). The model's classes must be importable here: the host imports the model's script under the
    same unique module name first. ``trial``: only whether it unpacks (what pickles may still not unpickle: an exported
    program's module does not), its TorchScript modules not loaded."""
    data = mmap.mmap(fd, pickle_offset + pickle_bytes, flags=mmap.MAP_PRIVATE)
    pickled = bytes(data[pickle_offset : pickle_offset + pickle_bytes])
    return _Unpickler(io.BytesIO(pickled), data, trial).load()

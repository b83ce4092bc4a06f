"""Loaded TorchScript models held by the warm process and inherited by every model server forked from it.

When a LOAD names a model that the defaults will load (a ``model.pt``/``model.pth`` and no inference script), the
warm process loads it once, to host memory (``map_location="cpu"``: CUDA stays untouched), before it forks the
model's server; the default ``model_fn`` then takes it from here instead of reading and parsing the file again.
Another name for the same artifacts shares the same weights. An entry is released when the last server using it
exits (its models were unloaded), so UNLOAD gives the memory back. New entries evict old ones, least recently used
first, to stay within ``MME_MODEL_CACHE_MB``: dropping the warm process's reference frees nothing a server still
uses (its forked copy keeps the weights), it only stops new servers from sharing them.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mme_runtime.operations import metrics

logger = logging.getLogger(__name__)

MODEL_FILES = ("model.pt", "model.pth")
Key = tuple[str, int, int]


@dataclass
class Entry:
    key: Key
    model: Any
    size_bytes: int
    users: set[int] = field(default_factory=set)


class ModelCache:
    """The warm process's cache. Only the warm process changes it; forked servers only read their copy."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.entries: OrderedDict[Key, Entry] = OrderedDict()

    @property
    def size_bytes(self) -> int:
        return sum(entry.size_bytes for entry in self.entries.values())

    def prepare(self, model_dir: Path, program: str, submit_directory: str | None) -> Entry | None:
        """The entry for ``model_dir``, loading it first if the defaults will load it and it fits; else None."""
        if submit_directory or (model_dir / "code" / program).is_file():
            return None  # user code may bring its own model_fn: never run our loader for it
        path = model_file(model_dir)
        if path is None:
            return None
        key = key_for(path)
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            metrics.record_cache_lookup("model", hit=True)
            logger.info("model cache hit %s", path)
            return entry
        if not self._make_room(key[1]):
            logger.info("model cache: %s (%d MiB) does not fit in %d MiB", path, key[1] >> 20, self.limit_bytes >> 20)
            return None
        import torch

        started = time.monotonic()
        try:
            model = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
        except Exception as exc:  # not TorchScript, or unreadable: the server's own loader will report it
            logger.info("model cache: not caching %s (%s)", path, type(exc).__name__)
            return None
        entry = Entry(key, model, key[1])
        self.entries[key] = entry
        metrics.record_cache_lookup("model", hit=False)
        logger.info("model cache loaded %s seconds=%.2f size_mb=%d", path, time.monotonic() - started, key[1] >> 20)
        return entry

    def add_user(self, entry: Entry, pid: int) -> None:
        entry.users.add(pid)

    def remove_user(self, pid: int) -> None:
        """A server exited: release every entry it was the last user of."""
        for key, entry in list(self.entries.items()):
            entry.users.discard(pid)
            if not entry.users:
                self._release(key)

    def lookup(self, path: Path) -> Any | None:
        """In a forked server: the model the warm process loaded from ``path``, if it is still the same file."""
        entry = self.entries.get(key_for(path))
        return None if entry is None else entry.model

    def _make_room(self, needed: int) -> bool:
        if needed > self.limit_bytes:
            return False
        for key in list(self.entries):  # least recently used first
            if self.size_bytes + needed <= self.limit_bytes:
                break
            self._release(key)
        return True

    def _release(self, key: Key) -> None:
        entry = self.entries.pop(key)
        logger.info("model cache released %s", key[0])
        del entry
        gc.collect()


def model_file(model_dir: Path) -> Path | None:
    return next((model_dir / name for name in MODEL_FILES if (model_dir / name).is_file()), None)


def key_for(path: Path) -> Key:
    """Same path, size and modification time: the same artifacts (a rewritten file is a new key)."""
    resolved = path.resolve()
    stat = resolved.stat()
    return (str(resolved), stat.st_size, stat.st_mtime_ns)


# The process's cache: filled in the warm process, inherited (read-only) by servers forked from it.
cache = ModelCache(limit_bytes=0)

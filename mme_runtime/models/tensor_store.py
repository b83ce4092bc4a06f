"""The warm process's shared-memory files and the tensors in them, by content: a tensor equal to one already held is
held once, whatever the number of models that use it (fine-tunes of one base, duplicated checkpoints).

A package arrives from its loader with the digest of each storage (``model_package.py``). ``add`` points each blob
whose digest is known, and whose bytes really are equal (compared, never assumed from the digest), at the copy
already held, and gives the duplicate's pages back to the system (a hole punched in the new file). Each place a blob
lives is counted by the packages that use it: ``release`` (UNLOAD) punches out what no package uses any more and
closes a file once nothing in it is used, so no model loses a tensor another still needs. Never touches CUDA.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from mme_runtime.models.model_package import OWN_PAGES_BYTES, PAGE, Blob, Package

logger = logging.getLogger(__name__)

# A smaller blob shares its page with others (``model_package.py``): it is kept where it is (bytes, per model).
MIN_SHARED_BYTES = OWN_PAGES_BYTES
# Descriptors one message may carry to a device host (SCM_RIGHTS takes 253): a package uses at most this many files.
MAX_SEGMENTS = 200
_FALLOC_FL_KEEP_SIZE = 1
_FALLOC_FL_PUNCH_HOLE = 2

Location = tuple[int, int]  # (segment id, offset)


@dataclass
class _Segment:
    """One package's file: alive while its package is, or while another package uses a blob in it."""

    fd: int
    owned: bool = True  # its own package is still loaded
    digests: dict[int, str] = field(default_factory=dict)  # offset -> digest, for what the index points at here


class TensorStore:
    """Every package of the warm process, and the blobs they hold, counted by place."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.segments: dict[int, _Segment] = {}
        self.uses: Counter[Location] = Counter()  # packages that use each place
        self.sizes: dict[Location, int] = {}
        self.index: dict[str, Location] = {}  # digest -> the place its bytes are held
        self._next_id = 1

    def descriptors(self) -> list[int]:
        return [segment.fd for segment in self.segments.values()]

    def add(self, package: Package, share: bool = True) -> Package:
        """Takes ``package`` (its own file now belongs to the store) and returns it with every blob that equals one
        already held pointing there. ``share=False`` (the model opted out): its blobs stay its own, unshared."""
        segment_id, self._next_id = self._next_id, self._next_id + 1
        own = self.segments[segment_id] = _Segment(package.fd)
        ids = [segment_id]
        blobs: list[Blob] = []
        taken: set[Location] = set()  # a place this package uses already: two of its storages must not become one
        for blob in package.blobs:
            place = self._equal_held(blob, package.fd) if share and self.enabled else None
            if place is not None and place not in taken and (place[0] in ids or len(ids) < MAX_SEGMENTS):
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
            logger.info("%d of %d tensor bytes are held once for several models", shared, self.bytes_of(blobs))
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
        for (segment_id, offset), nbytes in unused:  # a file that stays for others' tensors gives these pages back
            if segment_id not in closing:
                _punch(self.segments[segment_id].fd, offset, nbytes)
        for segment_id in closing:  # the rest goes whole (punching it first would only cost time)
            os.close(self.segments.pop(segment_id).fd)

    def bytes_of(self, blobs: list[Blob] | tuple[Blob, ...]) -> int:
        return sum(blob.nbytes for blob in blobs)

    def shared_bytes(self, package: Package) -> int:
        """The bytes of the package's blobs that another package uses too (each such tensor counted here once)."""
        ids = package.segment_ids
        return sum(blob.nbytes for blob in package.blobs if ids and self.uses[(ids[blob.segment], blob.offset)] > 1)

    def _equal_held(self, blob: Blob, fd: int) -> Location | None:
        """Where a blob of equal bytes is held already; None when none is (or the digest lied: compared byte for
        byte, so a crafted collision gets its own copy)."""
        if not blob.digest or blob.nbytes < MIN_SHARED_BYTES:
            return None
        place = self.index.get(blob.digest)
        if place is None or self.sizes.get(place) != blob.nbytes:
            return None
        return place if _same_bytes(self.segments[place[0]].fd, place[1], fd, blob.offset, blob.nbytes) else None

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
        """Whether a file can go: its package is unloaded and no other package uses a tensor in it."""
        segment = self.segments.get(segment_id)
        return segment is not None and not segment.owned and not any(p[0] == segment_id for p in self.uses)


def _same_bytes(fd_a: int, offset_a: int, fd_b: int, offset_b: int, nbytes: int) -> bool:
    """Whether two files hold the same bytes at these offsets (memcmp over read-only mappings, unmapped after)."""
    start_a, start_b = offset_a - offset_a % PAGE, offset_b - offset_b % PAGE
    with (
        mmap.mmap(fd_a, offset_a - start_a + nbytes, mmap.MAP_SHARED, mmap.PROT_READ, offset=start_a) as a,
        mmap.mmap(fd_b, offset_b - start_b + nbytes, mmap.MAP_SHARED, mmap.PROT_READ, offset=start_b) as b,
    ):
        view_a = np.frombuffer(a, np.uint8, nbytes, offset_a - start_a)
        view_b = np.frombuffer(b, np.uint8, nbytes, offset_b - start_b)
        equal = bool(_memcmp(view_a.ctypes.data, view_b.ctypes.data, nbytes) == 0)
        del view_a, view_b  # the mappings close only once no array points into them
    return equal


def _punch(fd: int, offset: int, nbytes: int) -> None:
    """Gives the pages of ``[offset, offset + nbytes)`` back to the system; the file keeps its size. Only for what
    ``model_package`` packed on pages of its own (a blob of a page or more, or the pickle, last in its file)."""
    if offset % PAGE or nbytes < MIN_SHARED_BYTES:
        return
    start, end = offset, -(-(offset + nbytes) // PAGE) * PAGE
    mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    if _libc.fallocate(fd, mode, start, end - start) != 0:
        error = ctypes.get_errno()
        logger.warning("could not give back %d bytes of a model file: %s", end - start, os.strerror(error))


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.fallocate.restype = ctypes.c_int
_memcmp = _libc.memcmp
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_memcmp.restype = ctypes.c_int

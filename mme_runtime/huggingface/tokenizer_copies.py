"""Copies of a tokenizer, lent to threads one step at a time.

A fast tokenizer is not safe to share between threads that change its truncation and padding (tokenizers 0.23
hands one thread another's settings; older versions raised "Already borrowed"), so a thread tokenizes with a copy
that no other thread uses meanwhile. Kept per thread and per model, those copies outweighed everything else a model
adds beyond its weights: a copy of BERT's tokenizer (30,522 entries) is about 3.7 MiB, every thread that served a
model made one, and each adapter of a base made its own. So copies are lent instead: a thread borrows one for a
step (preparing a batch's inputs, or making its answers) and gives it back, and a copy is made only when all are
out. Models that share a tokenizer object (the adapters of one base) share its copies: there are as many as steps
that ever ran at once, not threads times models.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_registry_lock = threading.Lock()
_copies: dict[int, TokenizerCopies] = {}  # by id() of the tokenizer; an entry leaves with its tokenizer


class TokenizerCopies:
    """The copies of one tokenizer. It holds the tokenizer weakly: the copies go when the models that hold it do."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = weakref.ref(tokenizer)
        self._lock = threading.Lock()
        self._free: list[Any] = []
        self.made = 0

    @contextmanager
    def lend(self) -> Iterator[Any]:
        with self._lock:
            own = self._free.pop() if self._free else None
        if own is None:
            own = self._copy()
        try:
            yield own
        finally:
            with self._lock:
                self._free.append(own)

    def _copy(self) -> Any:
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise RuntimeError("the tokenizer was released while its model still serves")
        own = copy.deepcopy(tokenizer)
        with self._lock:
            self.made += 1
        return own


def copies_of(tokenizer: Any) -> TokenizerCopies:
    """The one ``TokenizerCopies`` of ``tokenizer`` in this process."""
    key = id(tokenizer)
    with _registry_lock:
        copies = _copies.get(key)
        if copies is None:
            copies = _copies[key] = TokenizerCopies(tokenizer)
            weakref.finalize(tokenizer, _forget, key, copies)
    return copies


def _forget(key: int, copies: TokenizerCopies) -> None:
    with _registry_lock:
        if _copies.get(key) is copies:  # an id is reused only after its object is gone
            del _copies[key]


@contextmanager
def lent_tokenizer(tokenizer: Any) -> Iterator[Any]:
    """A copy of ``tokenizer`` for this step (None for a model without one)."""
    if tokenizer is None:
        yield None
        return
    with copies_of(tokenizer).lend() as own:
        yield own


@contextmanager
def lent_pipeline(pipeline: Any) -> Iterator[Any]:
    """A shallow copy of a transformers pipeline with a lent copy of its tokenizer, for this step."""
    with lent_tokenizer(pipeline.tokenizer) as tokenizer:
        own = copy.copy(pipeline)
        own.tokenizer = tokenizer
        yield own

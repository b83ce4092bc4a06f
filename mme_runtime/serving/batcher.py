"""Dynamic batching: requests to one model on one device, gathered into one ``predict_fn`` call.

Each frontend connection's thread submits its decoded requests (``Job``) and waits; one dispatcher
thread runs the forward passes, one at a time. When it is idle a request is dispatched at once, so a
lone client pays no delay. While a pass runs, what arrives queues up. After a pass that answered n
requests, the dispatcher expects n requests back (busy clients send their next one at once, through
whichever frontend connection is free) and waits for them, but never longer than ``max_delay`` after
that pass (then it stops expecting them: a lone request after a burst is not held), and a batch
never holds more than ``batch_size``. Only requests with the same collation signature share a batch;
the oldest waiting request decides which signature goes next. ``collate`` joins the inputs of a
batch along their first dimension (a tensor, or a dict, list or tuple of tensors with one row count)
and ``split`` cuts the prediction back into each request's rows.

A batch that fails with a retryable error (out of memory, or a client error that one request may
have caused) is split in halves and retried, so the error lands on the request that caused it,
alone. On a GPU the passes run on the device host's pass threads (``pass_threads.py``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from mme_runtime.base.errors import ContainerError
from mme_runtime.operations import metrics
from mme_runtime.serving.pass_threads import RunPass, run_here

# (structure, key or None, trailing shape, dtype) per tensor: hashable, equal for collatable inputs.
Signature = tuple[Any, ...]


class SplitError(ContainerError):
    """A batched prediction that cannot be handed back row by row: 500, naming the cause."""


@runtime_checkable
class Collatable(Protocol):
    """An input that knows how it batches: ``join`` makes one input of several with equal
    signatures; the prediction for it must hold one entry per row, in order (``split`` hands each
    its own)."""

    rows: int

    def batch_signature(self) -> Signature | None: ...

    @staticmethod
    def join(inputs: Sequence[Any]) -> Any: ...


def signature(data: Any) -> Signature | None:
    """What a request's decoded input must share with others to be batched with them, or None when
    it cannot be."""
    if isinstance(data, Collatable):
        return data.batch_signature()
    if isinstance(data, torch.Tensor):
        if data.dim() == 0 or data.shape[0] == 0:
            return None
        return ("tensor", tuple(data.shape[1:]), data.dtype, data.device)
    if isinstance(data, dict) and data and all(isinstance(key, str) for key in data):
        keys = sorted(data)
        return _structure("dict", [data[key] for key in keys], tuple(keys))
    if isinstance(data, (list, tuple)) and data:
        return _structure(type(data).__name__, list(data), None)
    return None


def _structure(kind: str, values: list[Any], keys: tuple[str, ...] | None) -> Signature | None:
    """Several tensors with one first dimension (their rows) collate together; anything else does
    not."""
    parts = [signature(value) if isinstance(value, torch.Tensor) else None for value in values]
    if any(part is None for part in parts) or len({int(value.shape[0]) for value in values}) != 1:
        return None
    return (kind, keys, *parts)


def rows(data: Any) -> int:
    """How many rows an input with a signature holds: its first dimension."""
    if isinstance(data, Collatable):
        return data.rows
    if isinstance(data, torch.Tensor):
        return int(data.shape[0])
    first = next(iter(data.values())) if isinstance(data, dict) else data[0]
    return int(first.shape[0])


def collate(inputs: Sequence[Any]) -> Any:
    """Joins inputs of one signature along the first dimension."""
    first = inputs[0]
    if len(inputs) == 1:
        return first
    if isinstance(first, Collatable):
        return first.join(inputs)
    if isinstance(first, torch.Tensor):
        return torch.cat(list(inputs))
    if isinstance(first, dict):
        return {key: torch.cat([item[key] for item in inputs]) for key in first}
    joined = [torch.cat([item[index] for item in inputs]) for index in range(len(first))]
    return tuple(joined) if isinstance(first, tuple) else joined


def split(prediction: Any, counts: Sequence[int]) -> list[Any]:
    """Hands a batched prediction back: one part per request, ``counts[i]`` rows each.

    Raises ``SplitError`` naming the cause when the prediction's first dimension does not add up.
    """
    if len(counts) == 1:
        return [prediction]
    total = sum(counts)
    if isinstance(prediction, torch.Tensor):
        if prediction.dim() == 0 or prediction.shape[0] != total:
            got = "a scalar" if prediction.dim() == 0 else f"{prediction.shape[0]} rows"
            raise SplitError(
                f"predict_fn returned {got} for a batch of {total} rows from {len(counts)} "
                "requests; with batching on, predict_fn must answer one row per input row"
            )
        return list(torch.split(prediction, list(counts)))
    if isinstance(prediction, dict):
        parts = {key: split(value, counts) for key, value in prediction.items()}
        return [{key: parts[key][index] for key in prediction} for index in range(len(counts))]
    if isinstance(prediction, (list, tuple)):
        batched = [
            isinstance(p, torch.Tensor) and p.dim() > 0 and p.shape[0] == total for p in prediction
        ]
        if prediction and all(batched):  # several outputs, each with the batch's rows
            columns = [split(value, counts) for value in prediction]
            return [
                type(prediction)(column[index] for column in columns)
                for index in range(len(counts))
            ]
        # One entry per row (a list made by .tolist(), say); a tuple is always several outputs, and
        # a list holding a batched tensor is not rows either: cut by position, it would hand one
        # request another's rows.
        if isinstance(prediction, list) and len(prediction) == total and not any(batched):
            offsets = [sum(counts[:index]) for index in range(len(counts) + 1)]
            return [prediction[offsets[i] : offsets[i + 1]] for i in range(len(counts))]
        raise SplitError(
            f"predict_fn returned a {type(prediction).__name__} of {len(prediction)} entries for a "
            f"batch of {total} rows from {len(counts)} requests; with batching on, it must answer "
            "one row per input row, or a tuple of tensors with one row per input row each"
        )
    raise SplitError(
        f"predict_fn returned a {type(prediction).__name__} for a batch of {len(counts)} requests; "
        "with batching on it must return a tensor, or a dict, list or tuple of tensors, with one "
        "row per input row"
    )


logger = logging.getLogger(__name__)

# A dispatching thread with nothing to do for this long ends, and the OpenMP team its passes started
# ends with it (GNU OpenMP keeps a team per thread that runs a parallel op: a thread per core). The
# next request starts one again.
IDLE_SECONDS = 60.0


@dataclass(eq=False)
class Job:
    """One request's decoded input, waiting for its share of a forward pass."""

    data: Any
    # what the job answers (the contract's request); a lone job's predict gets it as its context
    request: Any
    signature: Signature | None  # None: runs alone
    rows: int
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    queued_at: float = 0.0
    # its model's runner, for a batcher several models share
    run_by: Callable[[list[Job]], None] | None = None
    # past its caller's deadline: "queued" (taken out, never run) or "running"
    late: str | None = None


def group(jobs: Iterable[Job], batch_size: int) -> list[list[Job]]:
    """Jobs in batches of at most ``batch_size`` with one signature each, in order of their first
    job."""
    batches: list[list[Job]] = []
    open_batches: dict[Signature, list[Job]] = {}
    for job in jobs:
        batch = open_batches.get(job.signature) if job.signature is not None else None
        if batch is None or len(batch) >= batch_size:
            batch = [job]
            batches.append(batch)
            if job.signature is not None:
                open_batches[job.signature] = batch
        else:
            batch.append(job)
    return batches


def run_batch(
    jobs: list[Job],
    predict: Callable[[Any, Any], Any],
    batch_context: Any,
    retry_in_halves: Callable[[BaseException], bool],
    before_retry: Callable[[], None] = lambda: None,
    around: Callable[[list[Job]], AbstractContextManager[Any]] = lambda jobs: nullcontext(),
) -> None:
    """One ``predict`` call for ``jobs`` (collated), each job getting its rows of the prediction or
    the error.

    A lone job's ``predict`` gets its own request; a batch's gets ``batch_context`` (the model's,
    with no request's headers).
    ``retry_in_halves`` says whether a batch that failed with an error is run again in two halves;
    ``before_retry`` runs first (freeing cached device memory, say), once the failed pass's frames
    are gone. ``around(jobs)`` holds each ``predict`` call (the rows of a pass over LoRA adapters,
    ``lora_layers.py``).
    """
    try:
        if len(jobs) == 1:
            with around(jobs):
                jobs[0].result = predict(jobs[0].data, jobs[0].request)
            return
        with around(jobs):
            prediction = predict(collate([job.data for job in jobs]), batch_context)
        for job, part in zip(jobs, split(prediction, [job.rows for job in jobs]), strict=True):
            job.result = part
        return
    except SplitError as exc:
        for job in jobs:
            job.error = exc
        return
    except Exception as exc:  # noqa: BLE001
        # each request of the batch answers with it, unless halves retry
        if len(jobs) == 1 or not retry_in_halves(exc):
            for job in jobs:
                job.error = exc
            return
        logger.info("batch of %d failed (%s): retrying in halves", len(jobs), type(exc).__name__)
    # Retried outside the handler, so the failed pass's frames (and their tensors) are already
    # released.
    before_retry()
    half = len(jobs) // 2
    run_batch(jobs[:half], predict, batch_context, retry_in_halves, before_retry, around)
    run_batch(jobs[half:], predict, batch_context, retry_in_halves, before_retry, around)


def run_by_first(jobs: list[Job]) -> None:
    """A pass run by the model of its first job: what a batcher several models share runs
    (``lora_layers.py``)."""
    assert jobs[0].run_by is not None
    jobs[0].run_by(jobs)


class Batcher:
    """The queue in front of one model's forward passes on one device, and the threads that run
    them: at most ``concurrency`` passes at once (stock MMS runs one request per worker at once; a
    model that batches needs one).

    One dispatching thread starts with it; another starts only when a request finds every one busy,
    up to ``concurrency``, and one idle for ``idle_seconds`` ends: a device host serves hundreds of
    models, most of them idle or asked one request at a time, and each thread costs memory (its
    stack, its OpenMP team). ``thread_started`` runs first in each thread and ``thread_ended`` last
    (the host marks it its model's). ``run_pass`` runs each pass (here, or on a GPU's
    ``PassThreads``) and returns when it is done.
    """

    def __init__(
        self,
        run: Callable[[list[Job]], None],
        batch_size: int,
        max_delay_ms: float,
        name: str,
        concurrency: int = 1,
        thread_started: Callable[[], None] = lambda: None,
        thread_ended: Callable[[], None] = lambda: None,
        idle_seconds: float = IDLE_SECONDS,
        run_pass: RunPass = run_here,
    ) -> None:
        self._run = run
        self._run_pass = run_pass
        self.batch_size = batch_size
        self.max_delay = max_delay_ms / 1000.0
        self._name = name
        self._concurrency = max(1, concurrency)
        self._thread_started, self._thread_ended = thread_started, thread_ended
        self._idle_seconds = idle_seconds
        self._queue: deque[Job] = deque()
        self._ready = threading.Condition()
        self._closed = False
        # Requests answered by the last pass and not yet followed by new ones, and when that pass
        # ended.
        self._awaited = 0
        self._pass_ended = 0.0
        self._running = 0  # dispatchers in a pass; the others wait for work
        self._started = 0  # dispatchers started so far: each thread's name is its number
        self._series = metrics.current()  # a device host's threads each record for their own model
        self.threads: list[threading.Thread] = []
        with self._ready:
            self._start_dispatcher()

    def close(self) -> None:
        """Ends the dispatching threads once the queue is empty (the model is unloaded: nothing new
        arrives)."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        for thread in list(self.threads):
            if thread is not threading.current_thread():
                thread.join()

    def withdraw(self, run_by: Callable[[list[Job]], None]) -> None:
        """Answers the queued jobs of one model that leaves a shared batcher (its UNLOAD) with an
        error, so that no pass of the others runs them through a model that is gone."""
        with self._ready:
            leaving = [job for job in self._queue if job.run_by == run_by]
            self._queue = deque(job for job in self._queue if job.run_by != run_by)
        for job in leaving:
            job.error = RuntimeError("the model was unloaded")
            job.done.set()

    def submit(self, jobs: list[Job], deadline: float | None = None) -> None:
        """Queues ``jobs`` (one message's requests) and returns once each has its result or error,
        or is ``late`` at ``deadline`` (``time.monotonic``): then a queued job leaves the queue, a
        running one runs on unread."""
        if not jobs:
            return
        now = time.monotonic()
        for job in jobs:
            job.queued_at = now
        with self._ready:
            if self._closed:  # the model was unloaded under this request
                for job in jobs:
                    job.error = RuntimeError("the model was unloaded")
                return
            self._queue.extend(jobs)
            self._awaited = max(0, self._awaited - len(jobs))
            while (
                len(self.threads) - self._running < len(self._queue)
                and len(self.threads) < self._concurrency
            ):
                # every dispatcher busy: one more, as the model's concurrency allows
                self._start_dispatcher()
            self._ready.notify()
        for job in jobs:
            if job.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                continue
            with self._ready:
                if job.done.is_set():
                    continue
                queued = job in self._queue
                if queued:
                    self._queue.remove(job)
            job.late = "queued" if queued else "running"

    def _start_dispatcher(self) -> None:
        """Called holding ``_ready``."""
        self._started += 1
        name = f"batcher-{self._name}-{self._started}"
        thread = threading.Thread(target=self._dispatch_forever, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _dispatch_forever(self) -> None:
        metrics.bind(self._series)
        self._thread_started()
        try:
            self._dispatch()
        finally:  # its ident may soon be another thread's: nothing may stay marked with it
            self._thread_ended()

    def _dispatch(self) -> None:
        while (batch := self._next_batch()) is not None:
            self._pass(batch)
            # nothing of the pass's requests and answers held while the next one is awaited (up
            # to a minute for an idle model)
            del batch

    def _pass(self, batch: list[Job]) -> None:
        """One batch: its pass run, its jobs answered, its waits and time counted."""
        started = time.monotonic()
        try:
            # timed from when the pass started (a GPU's pass threads may hold it back a moment)
            started = self._run_pass(functools.partial(self._timed_run, batch))
        except BaseException as exc:  # noqa: BLE001
            # the runner answers its own errors; this is a last guard
            logger.exception("batch runner failed")
            for job in batch:
                if job.result is None and job.error is None:
                    job.error = exc
        with self._ready:
            self._running -= 1
            self._awaited = len(batch)
            self._pass_ended = time.monotonic()
        for job in batch:  # after _awaited is set: an answered client may be back at once
            job.done.set()
        waits = [started - job.queued_at for job in batch]
        metrics.record_pass(waits, self._pass_ended - started, self.batch_size)

    def _timed_run(self, batch: list[Job]) -> float:
        """Runs the pass; returns when it started."""
        started = time.monotonic()
        self._run(batch)
        return started

    def _next_batch(self) -> list[Job] | None:
        """The next batch, once one is due; None once closed and empty, or idle too long. Every wait
        lets go of the lock, and meanwhile another dispatcher, a timed-out client or a model leaving
        may empty the queue: it is looked at anew after each one."""
        with self._ready:
            while True:
                if not self._queue:
                    if self._closed:
                        return None
                    if (
                        not self._ready.wait(self._idle_seconds)
                        and not self._queue
                        and not self._closed
                    ):
                        # a request from now on starts another
                        self.threads.remove(threading.current_thread())
                        return None
                    continue
                if self._awaited and not self._full():
                    remaining = self._pass_ended + self.max_delay - time.monotonic()
                    if remaining > 0:
                        self._ready.wait(remaining)
                        continue
                    # those clients are not coming back soon: stop holding anyone for them
                    self._awaited = 0
                self._running += 1
                return self._take()

    def _full(self) -> bool:
        if not self._queue:
            return False
        head = self._queue[0].signature
        if head is None or self.batch_size == 1:
            return True
        return sum(1 for job in self._queue if job.signature == head) >= self.batch_size

    def _take(self) -> list[Job]:
        """The oldest job and up to ``batch_size - 1`` more of its signature; the rest stay queued
        in order."""
        head = self._queue.popleft()
        batch = [head]
        if head.signature is None:
            return batch
        kept: deque[Job] = deque()
        while self._queue:
            job = self._queue.popleft()
            if len(batch) < self.batch_size and job.signature == head.signature:
                batch.append(job)
            else:
                kept.append(job)
        self._queue = kept
        return batch

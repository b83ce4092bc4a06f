"""Continuous (iteration-level) batching of one model's generations: one thread decodes a token for
every row of the batch per step; between steps, waiting rows join (up to ``max_rows`` in all) and
finished rows leave, so a long generation never holds a short one back and a lone client pays no
wait.

Callers' threads ``submit`` their rows and wait. A row leaves when it ends (its end token,
``max_new_tokens``, a stop sequence) or at its deadline, with what it has. A step that fails fails
the rows in it, never the next ones; one that runs out of memory fails with the error that
answers 507. A fault of the loop itself fails every row, and the rows submitted after it, with its
cause: no caller waits forever. Each step is recorded as a forward pass of its rows.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from typing import Any

import torch

from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface.decoding import STOP, TIME, DecodingBatch, Row
from mme_runtime.huggingface.kv_cache import KvBudget
from mme_runtime.operations import metrics
from mme_runtime.serving.pass_threads import RunPass, run_here

logger = logging.getLogger(__name__)

# While at least half the batch runs, rows that arrive one by one wait up to GATHER_STEPS steps for
# GATHER_ROWS of them to share one prefill pass (each pass costs a few milliseconds before its first
# token).
GATHER_ROWS, GATHER_STEPS = 3, 2
# A row waiting for KV cache room lets later rows that fit go first, until it has waited this long:
# then none passes it, so the batch drains to make room for it.
PATIENCE_SECONDS = 2.0
# How long an UNLOAD waits for its model's rows to leave a batch other models still decode in.
WITHDRAW_SECONDS = 10.0


class ModelUnloaded(RuntimeError):
    """The model left (its UNLOAD) while the row waited or ran."""


class Scheduler:
    """The queue in front of one model's generations and the thread that decodes them. The models
    over one base (its LoRA adapters, and the base itself) share one (``generation.py``): their
    rows decode in the same steps, each with its own adapter."""

    def __init__(
        self,
        batch: DecodingBatch,
        max_rows: int,
        name: str,
        run_pass: RunPass = run_here,
        budget: KvBudget | None = None,
    ) -> None:
        self.batch = batch
        self.budget = budget  # the KV cache its batch may hold (None: no bound)
        self._run_pass = run_pass  # where each step runs: a GPU's pass threads, or this thread
        self.max_rows = max(1, max_rows)
        self._waiting: deque[Row] = deque()
        self._events: dict[int, threading.Event] = {}
        self._ready = threading.Condition()
        self._closed = False
        self._held = 0  # steps the waiting rows have been held back to gather
        # models gone (their runners) whose rows still run, and what tells their UNLOAD they left
        self._withdrawn: dict[int, tuple[object, threading.Event]] = {}
        # what a row submitted too late gets
        self._failure: BaseException = ModelUnloaded("the model was unloaded")
        self._series = metrics.current()  # a device host's threads each record for their own model
        self.thread = threading.Thread(
            target=self._run_forever, name=f"generation-{name}", daemon=True
        )
        self.thread.start()

    def submit(self, rows: list[Row]) -> None:
        """Queues ``rows`` and returns once each has finished or failed (``row.finish``,
        ``row.error``)."""
        done = [threading.Event() for _ in rows]
        with self._ready:
            if self._closed:
                raise self._failure
            now = time.monotonic()
            for row, event in zip(rows, done, strict=True):
                row.joined_at = now
                self._events[id(row)] = event
            self._waiting.extend(rows)
            self._ready.notify()
        for event in done:
            event.wait()

    @property
    def closed(self) -> bool:
        return self._closed

    def withdraw(self, owner: object, timeout: float = WITHDRAW_SECONDS) -> None:
        """The model whose rows ``owner`` submitted is unloaded while other models' rows still
        decode here: its rows fail with ``ModelUnloaded``, and this returns once none of them is in
        the batch any more (at the end of the step under way), or after ``timeout``."""
        left = threading.Event()
        with self._ready:
            if self._closed:
                return
            self._withdrawn[id(owner)] = (owner, left)
            self._ready.notify()
        if self.thread is not threading.current_thread():
            left.wait(timeout)

    def close(self) -> None:
        """Ends the thread; rows waiting or running fail with ``ModelUnloaded``."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        if self.thread is not threading.current_thread():
            self.thread.join()

    def _run_forever(self) -> None:
        metrics.bind(self._series)
        error: BaseException = ModelUnloaded("the model was unloaded")
        try:
            with torch.inference_mode():
                while (joining := self._next_rows()) is not None:
                    self._run_pass(functools.partial(self._iterate, joining))
        except Exception as exc:  # noqa: BLE001
            # a fault of the loop itself: its callers must not wait forever
            logger.exception("the generation scheduler stopped")
            error = RuntimeError(f"the generation scheduler stopped: {exc}")
        with self._ready:
            self._closed, self._failure = True, error
            waiting, self._waiting = list(self._waiting), deque()
        try:
            waiting += self.batch.fail_all()
            self.batch.close()
        finally:
            for row in waiting:
                self._done(row, error)

    @torch.inference_mode()
    def _iterate(self, joining: list[Row]) -> None:
        """The joining rows prefilled, then one step of the batch; recorded as one pass of the rows
        in it."""
        started = time.monotonic()
        waits = {id(row): (row, started - row.joined_at) for row in joining}
        if joining:
            self._admit(joining)
        if self.batch.rows:
            decoding = self.batch.live
            try:
                self.batch.step()
            except Exception as exc:  # noqa: BLE001 - the rows of this step answer with it
                self._fail(self.batch.fail_all(), exc)
            self._finish(decoding)
            for row in decoding:
                waits.setdefault(id(row), (row, 0.0))
        self._record(list(waits.values()), time.monotonic() - started)

    def _record(self, rows: list[tuple[Row, float]], seconds: float) -> None:
        """A step as a pass of each model whose rows it decoded, in that model's series: how long
        its rows waited to join, and how long the step took."""
        by_series: dict[int, tuple[Any, list[float]]] = {}
        for row, wait in rows:
            series = row.series or self._series
            by_series.setdefault(id(series), (series, []))[1].append(wait)
        for series, waits in by_series.values():
            metrics.bind(series)
            metrics.record_pass(waits, seconds, self.max_rows)

    def _next_rows(self) -> list[Row] | None:
        """The rows that join before the next step (maybe none), or None once closed."""
        with self._ready:
            while not (self._closed or self._waiting or self.batch.rows or self._withdrawn):
                self._ready.wait()
            if self._closed:
                return None
            if self._withdrawn:
                self._drop_withdrawn()
            if self.batch.rows and not self.batch.joinable:
                # this model's rows cannot join a running batch: they wait for it to empty
                return []
            live = len(self.batch.live)
            if self._waiting and 2 * live >= self.max_rows and len(self._waiting) < GATHER_ROWS:
                # A busy batch: a lone arrival waits a step or two for others to share its prefill
                # pass.
                self._held += 1
                if self._held <= GATHER_STEPS:
                    return []
            self._held = 0
            return self._joining(self.max_rows - live)

    def reserved(self, prompt: int, max_new_tokens: int) -> tuple[int, int]:
        """The decoder tokens a row of a ``prompt``-token input may hold, and its cross-attention
        ones: a decoder-only model's prompt and new tokens; an encoder-decoder's start and new
        tokens, and its input."""
        if self.batch.encoder_decoder:
            return 1 + max_new_tokens, prompt
        return prompt + max_new_tokens, 0

    def check_room(self, prompt: int, max_new_tokens: int, rows: int = 1) -> None:
        """Raises ``InvalidInput`` (400) for a row (a beam group's ``rows``) that could not fit the
        KV budget even alone."""
        budget = self.budget
        if budget is None:
            return
        needed = budget.footprint(rows, *self.reserved(prompt, max_new_tokens))
        if needed > budget.tokens:
            beams = f", {rows} beams" if rows > 1 else ""
            raise InvalidInput(
                f"this input needs {budget.describe(needed)} of KV cache ({prompt} input tokens, "
                f"max_new_tokens={max_new_tokens}{beams}, and the room its buffers keep), and this "
                f"model's decoding batch holds at most {budget.describe(budget.tokens)} "
                f"({budget.source}): ask fewer new tokens or send a shorter input"
            )

    def _joining(self, room: int) -> list[Row]:
        """The waiting rows that join now, in order, within ``room`` rows and the KV budget. A beam
        group's rows join together or wait together; one wider than ``room`` joins an empty batch.
        A row (or group) that does not fit waits and the rows behind it that fit go first, until it
        has waited ``PATIENCE_SECONDS``."""
        budget, rows = self.budget, self.batch.rows
        if budget is None and all(row.group is None for row in self._waiting):
            return [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        # the batch's places, the empty ones, the most a row reserves (decoder, cross-attention)
        state = (0, 0, 0, 0)
        if budget is not None:
            reserved = [self._reserved(row) for row in self.batch.live]
            state = (
                len(rows),
                rows.count(None),
                max((decoder for decoder, _ in reserved), default=0),
                max((source for _, source in reserved), default=0),
            )
        joining: list[Row] = []
        waiting: deque[Row] = deque()
        patient = time.monotonic() - PATIENCE_SECONDS
        empty = not self.batch.live
        for unit in _units(self._waiting):
            after = state if budget is None else self._after(unit, *state)
            fits = budget is None or budget.footprint(after[0], *after[2:]) <= budget.tokens
            passing = bool(waiting) and waiting[0].joined_at < patient
            wide = empty and not joining  # a group wider than the batch, alone
            if (len(joining) + len(unit) <= room or wide) and fits and not passing:
                joining += unit
                state = after
            else:
                waiting.extend(unit)
        self._waiting = waiting
        return joining

    def _reserved(self, row: Row) -> tuple[int, int]:
        return self.reserved(len(row.prompt), row.max_new_tokens)

    def _after(
        self, unit: list[Row], slots: int, holes: int, longest: int, source: int
    ) -> tuple[int, int, int, int]:
        """The batch's places, empty places and most reserved once ``unit`` joins: each row in a
        finished row's place where ``DecodingBatch._place`` writes it there, else added."""
        width = self.batch.mask.shape[1] if self.batch.rows else 0
        for row in unit:
            in_hole = holes > 0 and len(row.tokens or row.prompt) <= width
            if self.batch.encoder_decoder:
                in_hole = in_hole and len(row.prompt) <= self.batch.encoded.shape[1]
            slots, holes = (slots, holes - 1) if in_hole else (slots + 1, holes)
            decoder, cross = self._reserved(row)
            longest, source = max(longest, decoder), max(source, cross)
        return slots, holes, longest, source

    def _drop_withdrawn(self) -> None:
        """The rows of models withdrawn leave the queue and the batch, failed; their UNLOADs go
        on."""
        gone, self._withdrawn = self._withdrawn, {}
        leaving = [row for row in self._waiting if id(row.owner) in gone]
        self._waiting = deque(row for row in self._waiting if id(row.owner) not in gone)
        running = [row for row in self.batch.live if id(row.owner) in gone]
        if running:
            self.batch.drop(running)
        for row in leaving + running:
            self._done(row, ModelUnloaded(f"the model {row.model} was unloaded"))
        for _, left in gone.values():
            left.set()

    def _admit(self, rows: list[Row]) -> None:
        """Prefills the joining rows; if that fails they fail, and the running rows only if the
        batch was touched."""
        try:
            self.batch.admit(rows)
        except Exception as exc:  # noqa: BLE001 - the joining rows answer with it
            if self.batch.consistent():
                self.batch.drop(rows)  # those it had taken in already
                self._fail(rows, exc)
            else:
                self._fail([*rows, *(row for row in self.batch.fail_all() if row not in rows)], exc)
            return
        self._finish(rows)

    def _fail(self, rows: list[Row], exc: BaseException) -> None:
        logger.warning("a generation step of %d rows failed: %s", len(rows), exc)
        for row in rows:
            self._done(row, exc)

    def _finish(self, rows: list[Row]) -> None:
        """Rows that ended leave the batch and wake their callers."""
        now = time.monotonic()
        leaving = []
        for row in rows:
            if row.error is not None:
                continue
            if row.finish is None and row.stopped is not None and row.stopped(row):
                row.finish = STOP
            if row.finish is None and now >= row.deadline:
                row.finish = TIME
            if row.finish is not None:
                leaving.append(row)
        if leaving:
            self.batch.drop(leaving)
            for row in leaving:
                self._done(row, None)

    def _done(self, row: Row, error: BaseException | None) -> None:
        if error is not None:
            row.error = error
        with self._ready:
            event = self._events.pop(id(row), None)
        if event is not None:
            event.set()


def _units(rows: deque[Row]) -> list[list[Row]]:
    """The waiting rows in order, a beam group's rows as one unit (they are queued one after
    another)."""
    units: list[list[Row]] = []
    for row in rows:
        if row.group is not None and units and units[-1][0].group is row.group:
            units[-1].append(row)
        else:
            units.append([row])
    return units

"""The generation scheduler on its own, over a batch that only counts (no model): rows join between steps up to the
cap, a long row never holds short ones back, a failing step fails its rows only, and an UNLOAD answers the rest."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from mme_runtime.huggingface.decoding import LENGTH, TIME, Row
from mme_runtime.huggingface.scheduler import ModelUnloaded, Scheduler


class CountingBatch:
    """What the scheduler asks of ``DecodingBatch``: each step adds one token to every row."""

    def __init__(self, joinable: bool = True, fail_on_step: int | None = None, step_seconds: float = 0.0) -> None:
        self.rows: list[Row] = []
        self.joinable = joinable
        self.steps: list[int] = []  # rows in each step
        self.admitted: list[list[Row]] = []  # the rows of each prefill
        self.fail_on_step = fail_on_step
        self.step_seconds = step_seconds
        self.closed = False

    @property
    def live(self) -> list[Row]:
        return list(self.rows)

    def admit(self, rows: list[Row]) -> None:
        if any(row.prompt == [-1] for row in rows):
            raise ValueError("this prompt cannot be prefilled")
        self.admitted.append(list(rows))
        self.rows += rows
        self._token(rows)

    def step(self) -> None:
        self.steps.append(len(self.rows))
        if self.fail_on_step == len(self.steps):
            raise RuntimeError("step failed")
        time.sleep(self.step_seconds)
        self._token(self.rows)

    def _token(self, rows: list[Row]) -> None:
        for row in rows:
            row.tokens.append(len(row.tokens))
            row.generated += 1
            if row.generated >= row.max_new_tokens:
                row.finish = LENGTH

    def drop(self, leaving: list[Row]) -> None:
        self.rows = [row for row in self.rows if row not in leaving]

    def fail_all(self) -> list[Row]:
        rows, self.rows = self.rows, []
        return rows

    def consistent(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


def _submit_all(scheduler: Scheduler, groups: list[list[Row]]) -> dict[int, float]:
    """Submits each group from a thread of its own; returns when each group was answered."""
    answered: dict[int, float] = {}
    start = threading.Barrier(len(groups))

    def client(index: int) -> None:
        start.wait()
        scheduler.submit(groups[index])
        answered[index] = time.monotonic()

    threads = [threading.Thread(target=client, args=(index,)) for index in range(len(groups))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return answered


def test_a_long_generation_does_not_hold_short_ones_back() -> None:
    batch = CountingBatch(step_seconds=0.002)
    scheduler = Scheduler(batch, max_rows=16, name="test")  # type: ignore[arg-type]
    try:
        long, shorts = Row([1], 200), [Row([1], 3 + index) for index in range(8)]
        answered = _submit_all(scheduler, [[long], *([short] for short in shorts)])
        assert all(answered[index] < answered[0] for index in range(1, 9))
        assert [row.generated for row in shorts] == [3 + index for index in range(8)] and long.generated == 200
        assert max(batch.steps) > 1  # they shared steps
    finally:
        scheduler.close()


def test_rows_join_between_steps_up_to_max_rows() -> None:
    batch = CountingBatch(step_seconds=0.001)
    scheduler = Scheduler(batch, max_rows=4, name="test")  # type: ignore[arg-type]
    try:
        rows = [Row([1], 5 + index % 3) for index in range(12)]
        _submit_all(scheduler, [[row] for row in rows])
        assert max(batch.steps) <= 4 and all(row.finish == LENGTH for row in rows)
    finally:
        scheduler.close()


class Beams:
    """What the scheduler reads of a beam group (``beams.BeamGroup``): its rows and how many."""

    def __init__(self, rows: list[Row]) -> None:
        self.rows, self.size = rows, len(rows)
        for row in rows:
            row.group = self


def test_a_beam_groups_rows_join_together_and_one_wider_than_the_batch_runs_alone() -> None:
    batch = CountingBatch(step_seconds=0.001)
    scheduler = Scheduler(batch, max_rows=4, name="test")  # type: ignore[arg-type]
    try:
        narrow, wide = Beams([Row([1], 4) for _ in range(3)]), Beams([Row([1], 3) for _ in range(6)])
        singles = [Row([1], 6) for _ in range(3)]
        _submit_all(scheduler, [singles[:1], narrow.rows, wide.rows, singles[1:2], singles[2:]])
        for group in (narrow, wide):
            assert all(sum(row in joined for row in group.rows) in (0, group.size) for joined in batch.admitted)
        assert 6 in batch.steps and max(batch.steps) == 6  # the wide group ran, alone
        assert all(row.finish == LENGTH for row in [*narrow.rows, *wide.rows, *singles])
    finally:
        scheduler.close()


def test_rows_of_a_model_that_cannot_join_wait_for_the_batch_to_empty() -> None:
    batch = CountingBatch(joinable=False, step_seconds=0.001)
    scheduler = Scheduler(batch, max_rows=8, name="test")  # type: ignore[arg-type]
    try:
        first = [Row([1], 20), Row([1], 2)]
        waiting = threading.Thread(target=scheduler.submit, args=(first,))
        waiting.start()
        time.sleep(0.005)
        late = Row([1], 2)
        scheduler.submit([late])
        waiting.join(10)
        assert all(row.finish == LENGTH for row in [*first, late])
        assert batch.steps.count(3) == 0  # the late row never ran beside the first two
    finally:
        scheduler.close()


def test_a_failed_step_fails_its_rows_and_the_next_ones_run() -> None:
    batch = CountingBatch(fail_on_step=2)
    scheduler = Scheduler(batch, max_rows=8, name="test")  # type: ignore[arg-type]
    try:
        failed = [Row([1], 10), Row([1], 10)]
        scheduler.submit(failed)
        assert all(isinstance(row.error, RuntimeError) for row in failed)
        after = Row([1], 3)
        scheduler.submit([after])
        assert after.error is None and after.finish == LENGTH
    finally:
        scheduler.close()


def test_a_prompt_that_fails_its_prefill_fails_alone() -> None:
    batch = CountingBatch(step_seconds=0.002)
    scheduler = Scheduler(batch, max_rows=8, name="test")  # type: ignore[arg-type]
    try:
        running = Row([1], 50)
        thread = threading.Thread(target=scheduler.submit, args=([running],))
        thread.start()
        time.sleep(0.01)
        bad = Row([-1], 5)
        scheduler.submit([bad])
        thread.join(10)
        assert isinstance(bad.error, ValueError) and running.error is None and running.generated == 50
    finally:
        scheduler.close()


def test_a_row_past_its_deadline_leaves_with_what_it_has() -> None:
    scheduler = Scheduler(CountingBatch(step_seconds=0.002), max_rows=8, name="test")  # type: ignore[arg-type]
    try:
        row = Row([1], 10_000)
        row.deadline = time.monotonic() + 0.05
        scheduler.submit([row])
        assert row.finish == TIME and 0 < row.generated < 10_000
    finally:
        scheduler.close()


def test_a_stop_check_ends_a_row() -> None:
    scheduler = Scheduler(CountingBatch(), max_rows=8, name="test")  # type: ignore[arg-type]
    try:
        row = Row([1], 100)
        row.stopped = lambda row: row.generated == 7
        scheduler.submit([row])
        assert (row.finish, row.generated) == ("stop", 7)
    finally:
        scheduler.close()


def test_closing_answers_running_and_waiting_rows_and_refuses_new_ones() -> None:
    batch = CountingBatch(step_seconds=0.01)
    scheduler = Scheduler(batch, max_rows=1, name="test")  # type: ignore[arg-type]
    rows = [Row([1], 10_000), Row([1], 10_000)]
    threads = [threading.Thread(target=scheduler.submit, args=([row],)) for row in rows]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    scheduler.close()
    for thread in threads:
        thread.join(10)
    assert all(isinstance(row.error, ModelUnloaded) for row in rows) and batch.closed
    with pytest.raises(ModelUnloaded):
        scheduler.submit([Row([1], 1)])


def test_each_step_is_recorded_as_a_pass_of_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from mme_runtime.operations import metrics

    passes: list[Any] = []
    monkeypatch.setattr(metrics, "record_pass", lambda waits, seconds, size: passes.append((len(waits), size)))
    scheduler = Scheduler(CountingBatch(), max_rows=4, name="test")  # type: ignore[arg-type]
    try:
        scheduler.submit([Row([1], 3), Row([1], 3)])
    finally:
        scheduler.close()
    assert passes and passes[0] == (2, 4)


def test_a_fault_of_the_loop_itself_fails_every_row_and_the_next_ones_instead_of_hanging() -> None:
    class Broken(CountingBatch):
        @property
        def live(self) -> list[Row]:
            raise AttributeError("a bug")

    scheduler = Scheduler(Broken(), max_rows=8, name="test")  # type: ignore[arg-type]
    rows = [Row([1], 5), Row([1], 5)]
    scheduler.submit(rows)
    assert all(isinstance(row.error, RuntimeError) and "a bug" in str(row.error) for row in rows)
    with pytest.raises(RuntimeError, match="scheduler stopped"):
        scheduler.submit([Row([1], 1)])
    scheduler.close()

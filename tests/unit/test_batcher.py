"""The batcher on its own: when it dispatches, what it gathers, and how a failing batch is retried."""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from serving import wait_until

from mme_runtime.base.errors import InvalidInput
from mme_runtime.processes.crash_board import CrashBoard
from mme_runtime.serving.batcher import Batcher, Job, group, run_batch, signature
from mme_runtime.serving.pass_threads import PassThreads


def job(data: Any) -> Job:
    sig = signature(data)
    return Job(data, None, sig, int(data.shape[0]) if sig is not None else 1)


def doubling(data: Any, _context: Any) -> Any:
    return data * 2


def never_retry(_exc: BaseException) -> bool:
    return False


class Recorder:
    """A batch runner that records each pass's row count; ``hold`` keeps the next pass running until released."""

    def __init__(self) -> None:
        self.passes: list[int] = []
        self.running = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def hold(self) -> None:
        self.running.clear()
        self.release.clear()

    def __call__(self, jobs: list[Job]) -> None:
        self.running.set()
        self.release.wait(5)
        self.passes.append(sum(j.rows for j in jobs))
        run_batch(jobs, doubling, None, never_retry)


def queued(batcher: Batcher, count: int) -> bool:
    """Waits until ``count`` jobs are queued behind the running pass."""
    deadline = time.monotonic() + 5
    while len(batcher._queue) < count and time.monotonic() < deadline:
        time.sleep(0.001)
    return len(batcher._queue) >= count


def submit_in_thread(batcher: Batcher, jobs: list[Job]) -> threading.Thread:
    thread = threading.Thread(target=batcher.submit, args=(jobs,))
    thread.start()
    return thread


def test_group_keeps_signatures_apart_and_respects_the_batch_size() -> None:
    a1, b1, a2, a3 = job(torch.zeros(1, 4)), job(torch.zeros(1, 5)), job(torch.zeros(2, 4)), job(torch.zeros(1, 4))
    assert group([a1, b1, a2, a3], 2) == [[a1, a2], [b1], [a3]]
    alone = Job("text", None, None, 1)
    assert group([alone, job(torch.zeros(1, 4))], 8)[0] == [alone]


def test_each_job_gets_its_own_rows_of_one_prediction() -> None:
    jobs = [job(torch.full((count, 2), float(count))) for count in (1, 3, 2)]
    calls = []
    run_batch(jobs, lambda data, context: calls.append(data.shape[0]) or data + 1, None, never_retry)
    assert calls == [6]
    assert [j.result.tolist()[0][0] for j in jobs] == [2.0, 4.0, 3.0]
    assert [j.result.shape[0] for j in jobs] == [1, 3, 2]


def test_a_batch_that_runs_out_of_memory_is_retried_in_halves_down_to_what_fits() -> None:
    jobs = [job(torch.full((1, 2), float(index))) for index in range(5)]
    seen = []

    def predict(data: torch.Tensor, _context: Any) -> torch.Tensor:
        seen.append(data.shape[0])
        if data.shape[0] > 2:
            raise MemoryError("too big")
        return data

    run_batch(jobs, predict, None, lambda exc: isinstance(exc, MemoryError))
    assert all(j.error is None for j in jobs)
    assert [j.result.tolist() for j in jobs] == [[[float(i)] * 2] for i in range(5)]
    assert seen == [5, 2, 3, 1, 2]


def test_a_client_error_in_a_batch_lands_on_the_request_that_caused_it() -> None:
    jobs = [job(torch.full((1, 2), float(index))) for index in range(4)]

    def predict(data: torch.Tensor, _context: Any) -> torch.Tensor:
        if (data == 2).any():
            raise InvalidInput("value 2 is out of range")
        return data

    run_batch(jobs, predict, None, lambda exc: isinstance(exc, InvalidInput))
    assert [j.error is not None for j in jobs] == [False, False, True, False]


def test_a_lone_request_is_dispatched_at_once_whatever_the_delay() -> None:
    batcher = Batcher(Recorder(), batch_size=8, max_delay_ms=5000, name="lone")
    for _ in range(3):
        started = time.monotonic()
        request = job(torch.ones(1, 2))
        batcher.submit([request])
        assert time.monotonic() - started < 1.0
        assert torch.equal(request.result, torch.full((1, 2), 2.0))


def test_requests_arriving_during_a_pass_share_the_next_one_up_to_the_batch_size() -> None:
    recorder = Recorder()
    batcher = Batcher(recorder, batch_size=4, max_delay_ms=50, name="busy")
    recorder.hold()
    first = submit_in_thread(batcher, [job(torch.ones(1, 2))])
    assert recorder.running.wait(5)  # the first pass runs, held
    others = [submit_in_thread(batcher, [job(torch.ones(1, 2))]) for _ in range(6)]
    assert queued(batcher, 6)
    recorder.release.set()
    for thread in [first, *others]:
        thread.join(5)
    assert recorder.passes[0] == 1  # dispatched at once
    assert recorder.passes[1:] == [4, 2]  # then gathered, never beyond the batch size


def test_after_a_pass_it_waits_for_as_many_requests_as_it_answered() -> None:
    recorder = Recorder()
    batcher = Batcher(recorder, batch_size=8, max_delay_ms=300, name="awaited")
    recorder.hold()
    first = submit_in_thread(batcher, [job(torch.ones(1, 2))])
    assert recorder.running.wait(5)
    second = [submit_in_thread(batcher, [job(torch.ones(1, 2))]) for _ in range(3)]
    assert queued(batcher, 3)
    recorder.release.set()
    for thread in [first, *second]:
        thread.join(5)
    assert recorder.passes == [1, 3]
    # Three were answered: three clients coming back one after another still share one pass.
    threads = []
    for _ in range(3):
        threads.append(submit_in_thread(batcher, [job(torch.ones(1, 2))]))
        time.sleep(0.01)
    for thread in threads:
        thread.join(5)
    assert recorder.passes == [1, 3, 3]


def test_a_lone_request_after_a_burst_is_not_held_for_the_clients_that_left() -> None:
    recorder = Recorder()
    batcher = Batcher(recorder, batch_size=8, max_delay_ms=300, name="burst")
    recorder.hold()
    burst = [submit_in_thread(batcher, [job(torch.ones(1, 2))]) for _ in range(8)]
    assert recorder.running.wait(5)
    recorder.release.set()
    for thread in burst:
        thread.join(5)
    time.sleep(0.35)  # the burst's clients are gone: longer than the delay

    started = time.monotonic()
    batcher.submit([job(torch.ones(1, 2))])

    assert time.monotonic() - started < 0.15


def test_an_unbatched_model_runs_up_to_its_concurrency_of_passes_at_once() -> None:
    running, most = 0, 0
    lock = threading.Lock()

    def slow(jobs: list[Job]) -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.1)
        with lock:
            running -= 1
        for one in jobs:
            one.result = one.data

    batcher = Batcher(slow, batch_size=1, max_delay_ms=10, name="parallel", concurrency=3)
    started = time.monotonic()
    threads = [submit_in_thread(batcher, [Job(index, None, None, 1)]) for index in range(6)]
    for thread in threads:
        thread.join(5)
    assert most == 3  # never more than its bound, and the bound is used
    assert time.monotonic() - started < 0.45  # 6 passes of 0.1 s, 3 at a time: about 0.2 s, not 0.6


def test_dispatchers_start_as_passes_overlap_and_each_runs_the_hook_first() -> None:
    # A device host serves hundreds of models: one asked one request at a time keeps one thread, not its concurrency.
    marked: list[int] = []
    release = threading.Event()

    def blocking(jobs: list[Job]) -> None:
        release.wait(5)
        for one in jobs:
            one.result = one.data

    batcher = Batcher(
        blocking, 1, 10, name="lazy", concurrency=4, thread_started=lambda: marked.append(threading.get_ident())
    )
    release.set()
    for index in range(5):  # one at a time
        request = Job(index, None, None, 1)
        batcher.submit([request])
        assert request.result == index
    assert len(batcher.threads) == 1

    release.clear()
    clients = [submit_in_thread(batcher, [Job(index, None, None, 1)]) for index in range(7)]
    time.sleep(0.3)
    assert len(batcher.threads) == 4  # every one busy: more started, up to its concurrency and no further
    release.set()
    for thread in clients:
        thread.join(5)
    assert len(batcher.threads) == 4
    assert sorted(marked) == sorted(thread.ident for thread in batcher.threads)  # the hook ran in each, once
    batcher.close()


def test_an_idle_dispatcher_ends_and_the_next_request_starts_another() -> None:
    # Its OpenMP team (a thread per core, kept per thread that ran a parallel op) ends with it.
    ended: list[int] = []
    batcher = Batcher(
        Recorder(), 1, 10, name="idle", concurrency=2, idle_seconds=0.2, thread_ended=lambda: ended.append(1)
    )
    first = job(torch.ones(1, 2))
    batcher.submit([first])
    [thread] = batcher.threads
    thread.join(2)
    assert not thread.is_alive() and batcher.threads == [] and ended == [1]
    second = job(torch.ones(1, 2))
    batcher.submit([second], deadline=time.monotonic() + 5)
    assert torch.equal(second.result, torch.full((1, 2), 2.0)) and len(batcher.threads) == 1
    batcher.close()
    assert ended == [1, 1]


def test_an_idle_dispatcher_holds_nothing_of_the_requests_it_answered() -> None:
    # Its last pass's jobs, requests and answers were held until the next request or the idle end (a minute): at
    # thousands of idle models, each one's last answer (issue #37).
    batcher = Batcher(Recorder(), 1, 10, name="holds", idle_seconds=30)
    answered = job(torch.ones(1, 2))
    batcher.submit([answered])
    assert torch.equal(answered.result, torch.full((1, 2), 2.0))
    gone = weakref.ref(answered)
    del answered
    assert wait_until(lambda: gone() is None, 5, 0.01) and batcher.threads[0].is_alive()
    batcher.close()


def test_a_dispatcher_marked_on_the_crash_board_leaves_no_mark_when_it_ends() -> None:
    # Thread idents are reused at once: a mark left behind would blame its slot's next model for another's crash.
    board = CrashBoard()
    batcher = Batcher(
        Recorder(),
        1,
        10,
        name="marked",
        idle_seconds=0.2,
        thread_started=functools.partial(board.work_for, 7),
        thread_ended=board.done,
    )
    batcher.submit([job(torch.ones(1, 2))])
    [thread] = batcher.threads
    assert board.culprit(f"Current thread {thread.ident:#018x} (most recent call first):") == 7
    thread.join(2)
    assert board.culprit(f"Current thread {thread.ident:#018x} (most recent call first):") is None
    batcher.close()
    board.close()


def test_closing_ends_the_dispatchers_once_the_queue_is_done() -> None:
    batcher = Batcher(Recorder(), batch_size=4, max_delay_ms=10, name="closing", concurrency=2)
    request = job(torch.ones(1, 2))
    batcher.submit([request])
    batcher.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("batcher-closing")]
    assert torch.equal(request.result, torch.full((1, 2), 2.0))


def test_a_request_after_close_is_answered_with_an_error_not_held() -> None:
    batcher = Batcher(Recorder(), batch_size=1, max_delay_ms=10, name="gone")
    batcher.close()
    request = job(torch.ones(1, 2))
    batcher.submit([request])  # returns at once
    assert isinstance(request.error, RuntimeError) and "unloaded" in str(request.error)


def test_a_model_leaving_a_shared_batcher_takes_its_queued_jobs_and_no_others() -> None:
    """Adapters of one base share a batcher: the UNLOAD of one answers its queued jobs, the others still run."""
    release = threading.Event()
    ran: list[str] = []

    def runner(owner: str) -> Any:
        def run(jobs: list[Job]) -> None:
            release.wait(5)
            for each in jobs:
                ran.append(owner)
                each.result = each.data

        return run

    staying, leaving = runner("staying"), runner("leaving")
    batcher = Batcher(lambda jobs: jobs[0].run_by(jobs), 1, 0, "shared")  # type: ignore[misc]
    jobs = [job(torch.ones(1, 2)) for _ in range(3)]
    for each, run_by in zip(jobs, (staying, leaving, staying), strict=True):
        each.run_by = run_by
    threads = [threading.Thread(target=batcher.submit, args=([each],)) for each in jobs]
    threads[0].start()
    time.sleep(0.2)  # the first is running (held); the others queue behind it
    threads[1].start()
    threads[2].start()
    time.sleep(0.2)
    batcher.withdraw(leaving)
    release.set()
    for thread in threads:
        thread.join(5)
    batcher.close()
    assert str(jobs[1].error) == "the model was unloaded" and jobs[1].result is None
    assert ran == ["staying", "staying"]


def test_past_its_deadline_a_running_job_is_late_and_a_queued_one_leaves_the_queue() -> None:
    recorder = Recorder()
    batcher = Batcher(recorder, batch_size=1, max_delay_ms=0, name="late")
    recorder.hold()
    running, waiting = job(torch.ones(1, 2)), job(torch.ones(1, 2))
    first = threading.Thread(target=batcher.submit, args=([running], time.monotonic() + 0.3))
    first.start()
    assert recorder.running.wait(5)
    started = time.monotonic()
    batcher.submit([waiting], time.monotonic() + 0.2)
    assert 0.15 < time.monotonic() - started < 2
    assert waiting.late == "queued" and not batcher._queue  # it will never run for nobody
    first.join(5)
    assert running.late == "running"
    recorder.release.set()
    assert running.done.wait(5) and recorder.passes == [1]  # the pass ran on; its answer went unread
    on_time = job(torch.ones(1, 2))
    batcher.submit([on_time], time.monotonic() + 5)
    assert on_time.late is None and torch.equal(on_time.result, torch.full((1, 2), 2.0))


def test_a_queue_emptied_while_a_dispatcher_waited_never_ends_that_dispatcher() -> None:
    """After a pass the dispatcher waits for more requests; a timed-out client that leaves the queue meanwhile (or
    another dispatcher that takes its jobs) must leave it waiting for the next request, not dead of an empty queue."""

    def slow(jobs: list[Job]) -> None:
        time.sleep(0.3)
        for job in jobs:
            job.result = "ok"

    batcher = Batcher(slow, batch_size=4, max_delay_ms=1000, name="emptied")
    first = Job(1, None, ("s",), 1)
    running = threading.Thread(target=batcher.submit, args=([first],))
    running.start()
    time.sleep(0.1)
    leaving = Job(2, None, ("s",), 1)
    batcher.submit([leaving], deadline=time.monotonic() + 0.4)  # leaves the queue inside the wait after first's pass
    running.join()
    assert leaving.late == "queued" and first.result == "ok"
    time.sleep(1.2)  # the wait for first's client ends
    assert all(thread.is_alive() for thread in batcher.threads)
    after = Job(3, None, ("s",), 1)
    batcher.submit([after], deadline=time.monotonic() + 5)
    assert after.result == "ok" and after.late is None
    batcher.close()


def test_two_dispatchers_batching_never_take_from_an_empty_queue() -> None:
    def quick(jobs: list[Job]) -> None:
        time.sleep(0.005)
        for job in jobs:
            job.result = job.data

    batcher = Batcher(quick, batch_size=4, max_delay_ms=20, name="two", concurrency=2)
    answers: list[object] = []

    def client(offset: int) -> None:
        for index in range(offset, 150, 3):
            job = Job(index, None, ("s",), 1)
            batcher.submit([job], deadline=time.monotonic() + 10)
            answers.append(job.result)
            time.sleep(0.002 * (index % 4))

    clients = [threading.Thread(target=client, args=(offset,)) for offset in range(3)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    assert sorted(answers) == list(range(150))  # type: ignore[type-var]
    assert all(thread.is_alive() for thread in batcher.threads)
    batcher.close()


def test_the_passes_of_many_models_run_on_a_few_pass_threads_and_each_answers_its_own() -> None:
    # On a GPU each thread that runs a pass keeps a cuBLAS workspace on the card: threads must not grow with models.
    passes = PassThreads(2, "gpu0")
    ran_on: set[int] = set()

    def runner(jobs: list[Job]) -> None:
        ran_on.add(threading.get_ident())
        run_batch(jobs, doubling, None, never_retry)

    def run_pass(function: Callable[[], Any]) -> Any:
        return passes.run(function, None)

    batchers = [Batcher(runner, 4, 1, name=f"model{index}", run_pass=run_pass) for index in range(20)]
    jobs = [[job(torch.full((1, 2), float(index)))] for index in range(20)]
    threads = [submit_in_thread(batcher, own) for batcher, own in zip(batchers, jobs, strict=True)]
    for thread in threads:
        thread.join(5)
    for index, (own,) in enumerate(jobs):
        assert torch.equal(own.result, torch.full((1, 2), 2.0 * index))
    assert ran_on <= {thread.ident for thread in passes.threads} and len(passes.threads) <= 2
    for batcher in batchers:
        batcher.close()


def test_a_pass_thread_is_marked_as_its_model_s_during_its_pass_alone() -> None:
    board = CrashBoard()
    passes = PassThreads(1, "gpu0")
    seen: list[int | None] = []

    def culprit() -> int | None:
        return board.culprit(f"Current thread {threading.get_ident():#018x} (most recent call first):")

    for slot in (3, 9):
        started = functools.partial(board.work_for, slot)
        assert passes.run(lambda: seen.append(culprit()), None, started, board.done) is None
    [thread] = passes.threads
    assert seen == [3, 9]
    assert board.culprit(f"Current thread {thread.ident:#018x} (most recent call first):") is None
    board.close()


def test_what_a_pass_raises_reaches_its_caller_and_the_thread_serves_on() -> None:
    passes = PassThreads(1, "gpu0")

    def failing() -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        passes.run(failing, None)
    assert passes.run(lambda: 42, None) == 42
    assert len(passes.threads) == 1


def test_a_waiting_pass_thread_holds_nothing_of_the_pass_it_ran_last() -> None:
    # A GPU's pass thread kept its last pass, and through it that model, until its next pass (issue #37).
    passes = PassThreads(1, "gpu0")
    model = torch.nn.Linear(2, 2)
    gone = weakref.ref(model)
    assert passes.run(functools.partial(lambda model: 42, model), None) == 42
    del model
    assert wait_until(lambda: gone() is None, 5, 0.01) and passes.threads[0].is_alive()


def test_a_pass_that_hangs_holds_its_own_thread_and_the_next_pass_gets_another_that_ends_idle() -> None:
    passes = PassThreads(1, "gpu0", held_seconds=0.1, idle_seconds=0.3)
    release = threading.Event()
    hung = threading.Thread(target=passes.run, args=(release.wait, None))
    hung.start()
    started = time.monotonic()
    assert passes.run(lambda: "answered", None) == "answered"
    assert time.monotonic() - started < 2 and len(passes.threads) == 2
    release.set()
    hung.join(5)
    assert passes.run(lambda: "again", None) == "again" and len(passes.threads) == 2  # no third: two are free
    deadline = time.monotonic() + 5
    while len(passes.threads) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(passes.threads) == 1  # the one past count ended once idle
    assert passes.run(lambda: "still", None) == "still"


def test_a_busy_card_keeps_its_count_of_pass_threads() -> None:
    # Passes that merely queue behind a saturated device are no reason for more threads (each costs the card).
    # 12 callers behind a 20 ms device: each pass waits about 0.24 s, past held_seconds, 60 times over 1.2 s.
    passes = PassThreads(2, "gpu0", held_seconds=0.2)
    device = threading.Lock()

    def step() -> None:
        with device:
            time.sleep(0.02)

    def model() -> None:
        for _ in range(5):
            passes.run(step, None)

    callers = [threading.Thread(target=model) for _ in range(12)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(30)
    assert len(passes.threads) == 2


def test_a_hook_that_raises_fails_its_pass_alone_and_the_thread_serves_on() -> None:
    passes = PassThreads(1, "gpu0")

    def broken_hook() -> None:
        raise RuntimeError("board")

    with pytest.raises(RuntimeError, match="board"):
        passes.run(lambda: None, None, started=broken_hook)
    with pytest.raises(RuntimeError, match="board"):
        passes.run(lambda: None, None, ended=broken_hook)
    assert passes.run(lambda: "fine", None) == "fine" and len(passes.threads) == 1


def test_a_pass_that_runs_a_pass_runs_it_in_place() -> None:
    passes = PassThreads(1, "gpu0", held_seconds=5)
    started = time.monotonic()
    assert passes.run(lambda: passes.run(threading.get_ident, None), None) == passes.threads[0].ident
    assert time.monotonic() - started < 1 and len(passes.threads) == 1

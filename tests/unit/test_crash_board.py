"""Whose code killed a device host (mme_runtime/processes/crash_board.py): the board's slots, and the crashed thread's
stack from faulthandler's report."""

from __future__ import annotations

import threading

from mme_runtime.processes.crash_board import CrashBoard, crashed_stack

REPORT = """Fatal Python error: Aborted

Thread 0x00007fbfa5afc6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread {ident:#x} (most recent call first):
  File "/opt/ml/models/m/code/inference.py", line 8 in predict_fn
  File "/app/mme_runtime/serving/batcher.py", line 189 in _dispatch_forever

Extension modules: torch._C (total: 1)
"""


def test_the_crashed_thread_names_its_model_and_its_stack() -> None:
    board = CrashBoard()
    board.work_for(7)
    report = REPORT.format(ident=threading.get_ident())
    assert board.culprit(report) == 7
    assert crashed_stack(report) == (
        '  File "/opt/ml/models/m/code/inference.py", line 8 in predict_fn\n'
        '  File "/app/mme_runtime/serving/batcher.py", line 189 in _dispatch_forever'
    )
    assert crashed_stack("") == ""
    board.close()


def test_a_model_past_the_four_thousandth_has_a_slot_and_a_crash_finds_it_busy() -> None:
    board = CrashBoard()
    with board.running(60_000):
        assert board.busy() == [60_000]
    assert board.busy() == []
    board.close()

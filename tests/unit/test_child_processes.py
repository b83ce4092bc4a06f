"""``fork_child``, the one way a model process is made (what the child inherits and what it does not), the
``Watcher`` the warm process waits on its sockets with, and the entrypoint's one malloc arena."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from mme_runtime.base.child_processes import Watcher

PROBE = """
import json, os, signal, socket, sys, time
from mme_runtime.base.child_processes import fork_child

kept, dropped = socket.socketpair()
# a run of consecutive descriptors to close, but for one in its middle
run = [end for pair in (socket.socketpair() for _ in range(4)) for end in pair]
middle = run[3]
high = os.dup2(dropped.fileno(), 1023)  # the descriptor table's last (FDSize 1024)
report, theirs = socket.socketpair()
os.environ["PARENT_ONLY"] = "1"
signal.signal(signal.SIGTERM, signal.SIG_IGN)
out = open(sys.argv[1], "w")

def run_child():
    def is_open(fd):
        try:
            os.fstat(fd)
            return True
        except OSError:
            return False
    title = open("/proc/self/cmdline", "rb").read().split(b"\\0")[0].decode()
    print("to the given stdout", flush=True)
    theirs.sendall(json.dumps({
        "environment": dict(os.environ),
        "title": title,
        "kept": is_open(kept.fileno()),
        "kept_fds": keep,
        "dropped": is_open(dropped.fileno()),
        "high": is_open(high),
        "run": [is_open(end.fileno()) for end in run],
        "open": [int(name) for name in os.listdir("/proc/self/fd")],  # and the listing's own
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    }).encode())
    return 7

keep = [kept.fileno(), middle.fileno(), theirs.fileno()]
pid = fork_child("probe-title --model-name m", run_child, {"ONLY": "this"}, [0, out.fileno(), 2], keep)
theirs.close()
child = json.loads(report.recv(65536))
_, status = os.waitpid(pid, 0)
child["status"] = os.waitstatus_to_exitcode(status)
print(json.dumps(child))
"""


def test_a_forked_child_gets_what_it_is_given_and_nothing_it_is_not(tmp_path: Path) -> None:
    stdout = tmp_path / "stdout.txt"
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, str(stdout)], capture_output=True, text=True, timeout=60, check=True
    )
    child = json.loads(probe.stdout.strip().splitlines()[-1])
    assert child["environment"] == {"ONLY": "this"}  # its own environment, not the parent's
    assert child["title"] == "probe-title --model-name m"
    assert child["kept"] and not child["dropped"] and not child["high"]
    assert child["run"] == [False, False, False, True, False, False, False, False]  # all but the one it was given
    assert len(set(child["open"]) - {0, 1, 2, *child["kept_fds"]}) <= 1, child  # nothing else: the listing's own
    assert child["sigterm_default"]  # the parent's handler is not its own
    assert child["status"] == 7  # what run returned
    assert stdout.read_text() == "to the given stdout\n"


def test_a_forked_child_never_collects_a_socket_of_its_parent_onto_a_descriptor_of_its_own() -> None:
    # The parent's socket in a cycle not yet collected: the child closes its number and may reuse it; collecting the
    # socket there would close the child's descriptor under it.
    script = textwrap.dedent(
        """
        import gc, json, os, socket
        from mme_runtime.base.child_processes import fork_child

        class Holder:
            pass

        gc.disable()  # the parent has not collected it yet
        mine, _ = socket.socketpair()
        number = mine.fileno()
        cycle = Holder()
        cycle.me, cycle.socket = cycle, mine
        del mine, cycle
        report, theirs = socket.socketpair()

        def run_child():
            # no file object, whose own close would fail on a number the collection closed; and the collection
            # explicit (collection stays disabled), whatever the child allocated before it
            other = os.open(os.devnull, os.O_RDONLY)
            if other != number:
                os.dup2(other, number)  # the number, now the child's
            gc.collect()
            try:
                os.fstat(number)
                still_open = True
            except OSError:
                still_open = False
            theirs.sendall(json.dumps({"still_open": still_open}).encode())
            return 0

        pid = fork_child("probe", run_child, {}, [], [theirs.fileno()])
        theirs.close()
        print(report.recv(1000).decode())
        os.waitpid(pid, 0)
        """
    )
    probe = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(probe.stdout.strip().splitlines()[-1]) == {"still_open": True}, probe.stderr


def test_a_forked_child_dies_with_its_parent(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import os, sys, time
        from mme_runtime.base.child_processes import fork_child

        def run():
            time.sleep(60)
            return 0

        print(fork_child("orphan", run, {}), flush=True)
        time.sleep(60)
        """
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as parent:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        parent.kill()  # at once: maybe before the child could ask the kernel to tell it
        parent.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}").exists() else ""
    return " Z " not in stat  # a zombie has died; its new parent collects it


def test_the_watcher_calls_a_readable_socket_s_handler_until_it_is_forgotten() -> None:
    watcher = Watcher()
    calls: list[str] = []
    a, a_peer = socket.socketpair()
    b, b_peer = socket.socketpair()
    watcher.watch(a, lambda: calls.append("a"))
    watcher.watch(b, lambda: (calls.append("b"), watcher.forget(a)))  # b's handler forgets a, within one wait
    watcher.run_once(0.1)
    assert calls == []  # nothing to read yet
    a_peer.send(b"x")
    b_peer.send(b"x")
    watcher.run_once(1)
    assert sorted(calls) == ["a", "b"] or calls == ["b"]  # a runs unless b ran first and forgot it
    calls.clear()
    watcher.forget(b)
    b.close()
    c, c_peer = socket.socketpair()  # may take b's descriptor number
    watcher.watch(c, lambda: calls.append("c"))
    c_peer.send(b"x")
    watcher.run_once(1)
    assert calls == ["c"]  # a was forgotten, b is gone: only c
    for sock in (a, a_peer, b_peer, c, c_peer):
        sock.close()


def test_the_watcher_s_set_is_one_descriptor_that_a_forked_child_can_close() -> None:
    watcher = Watcher()
    pairs = [socket.socketpair() for _ in range(300)]
    calls: list[int] = []
    for index, (ours, _) in enumerate(pairs):
        watcher.watch(ours, lambda index=index: calls.append(index))  # type: ignore[misc]
    pairs[123][1].send(b"x")
    watcher.run_once(1)
    assert calls == [123]  # only the ready one
    ours, peer = pairs[7]
    watcher.forget(ours)
    ours.close()
    watcher.forget(ours)  # forgotten twice, closed: nothing to do
    for ours, peer in pairs:
        ours.close()
        peer.close()


ARENAS = """
import ctypes, sys, threading
from mme_runtime.base.child_processes import one_arena

if sys.argv[1] == "one":
    one_arena()

def allocate() -> None:
    kept = [bytearray(4096) for _ in range(200)]  # glibc's: a thread's first gets it an arena of its own

threads = [threading.Thread(target=allocate) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc = ctypes.CDLL("libc.so.6")
libc.malloc_info(0, ctypes.c_void_p.in_dll(libc, "stdout"))
"""


def test_one_arena_serves_every_thread_of_the_process() -> None:
    def heaps(mode: str) -> int:
        command = [sys.executable, "-c", ARENAS, mode]
        env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
        info = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=60).stdout
        return info.count("<heap nr=")

    assert heaps("default") > 1
    assert heaps("one") == 1

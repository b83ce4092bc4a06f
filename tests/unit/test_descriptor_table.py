"""A process's descriptor table: its size under any name, and the kernel's /proc entries of closed numbers, freed by
the low-priority process the warm process sends each stub to (launcher_entries.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from mme_runtime.processes.launcher_entries import listed_below

# A process lists its /proc/self/fd as the JDK's launcher does in every stub (an entry per open number, the
# frontend's), closes a number, then, once told, opens it again. An entry still cached keeps its inode number; a freed
# one is made afresh, with a new one.
LISTED = textwrap.dedent(
    """
    import os, sys
    number, kept = os.dup(1), os.dup(1)  # low numbers, as the frontend's are
    os.listdir("/proc/self/fd")
    inode = lambda fd: os.stat(f"/proc/self/fd/{fd}", follow_symlinks=False).st_ino
    before = (inode(number), inode(kept))
    os.close(number)
    print("listed", flush=True)
    sys.stdin.readline()
    os.dup2(1, number)
    after = (inode(number), inode(kept))
    print(before[0] != after[0], before[1] == after[1], flush=True)
    """
)

# What the warm process does for each stub, here in a process of its own: the low-priority process started, then
# ended (killed and reaped here, so the next stub meets a broken pipe and starts another), the listed process's pid
# sent, then one no process has; closing the queue ends the process once it has read it all.
LOW_PRIORITY_PROCESS = textwrap.dedent(
    """
    import os, signal, sys
    from mme_runtime.processes.launcher_entries import LauncherEntries
    entries = LauncherEntries(dict(os.environ))
    entries.start()
    first = entries.pid
    os.kill(first, signal.SIGKILL)
    os.waitpid(first, 0)
    entries.forget(int(sys.argv[1]))
    entries.forget(2**22 + 1)  # above any pid_max
    second = entries.pid
    entries.close()
    _, status = os.waitpid(second, 0)
    print(second not in (None, first), os.waitstatus_to_exitcode(status), os.getpriority(os.PRIO_PROCESS, 0))
    """
)


def test_the_descriptor_table_size_is_read_whatever_the_process_is_named() -> None:
    # A loader's name is its model's: one that is not ASCII once sent the bound to RLIMIT_NOFILE (often a million,
    # one close each where close_range is refused).
    script = textwrap.dedent(
        """
        import os, resource, setproctitle
        from mme_runtime.base.descriptor_table import descriptor_table_size
        setproctitle.setproctitle("mme-loader m\u00f6del")
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        os.dup2(1, 1000)  # the table grows to 1024
        print(descriptor_table_size())
        """
    )
    probe = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert probe.stdout.split()[-1] == "1024"


def test_the_low_priority_process_frees_the_entries_of_closed_numbers_a_listing_made_and_keeps_the_open_ones() -> None:
    assert _listed_process_after(forget=True) == "True True"


def test_without_it_a_number_closed_and_opened_again_finds_its_old_entry() -> None:
    # The control: what the test above tells apart.
    assert _listed_process_after(forget=False) == "False True"


def _listed_process_after(forget: bool) -> str:
    command = [sys.executable, "-c", LISTED]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as listed:
        assert listed.stdout is not None and listed.stdin is not None
        try:
            assert listed.stdout.readline().strip() == "listed"
            if forget:
                command = [sys.executable, "-c", LOW_PRIORITY_PROCESS, str(listed.pid)]
                done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
                assert done.stdout.split() == ["True", "0", "0"], done  # a new one, ended well; not this one's nice
            listed.stdin.write("go\n")
            listed.stdin.flush()
            return listed.stdout.readline().strip()
        finally:
            listed.kill()


def test_the_numbers_looked_up_are_bounded_by_what_the_stub_s_parent_holds() -> None:
    # The launcher listed the frontend's descriptors, numbered from 0: about as many as it holds, not the whole table.
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE) as child:
        try:
            held = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
            bound = listed_below(child.pid)
        finally:
            child.kill()
    assert bound is not None and held < bound <= held + held // 8 + 64 + 8

"""A process's descriptor table: its size under any name, and the kernel's /proc entries of closed numbers, freed by
the idle process the warm process sends each stub to."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A process lists its /proc/self/fd as the JDK's launcher does in every stub (an entry per open number), closes a
# number, then, once told, opens it again. An entry still cached keeps its inode number; a freed one is made afresh,
# with a new one.
LISTED = textwrap.dedent(
    """
    import fcntl, os, sys
    number = fcntl.fcntl(1, fcntl.F_DUPFD, 900)
    kept = fcntl.fcntl(1, fcntl.F_DUPFD, 900)
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

# What the warm process does for each stub: its pid down a pipe to launcher_entries.run, here in a process of its own
# (it puts itself at idle priority), which ends when the pipe closes.
IDLE_PROCESS = textwrap.dedent(
    """
    import os, sys
    from mme_runtime.processes.launcher_entries import PID, run
    read_end, write_end = os.pipe()
    os.write(write_end, PID.pack(int(sys.argv[1])) + PID.pack(2**31 - 1))  # the second has gone
    os.close(write_end)
    sys.exit(run(read_end))
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


def test_the_idle_process_frees_the_entries_of_closed_numbers_a_listing_made_and_keeps_the_open_ones() -> None:
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
                subprocess.run([sys.executable, "-c", IDLE_PROCESS, str(listed.pid)], timeout=60, check=True)
            listed.stdin.write("go\n")
            listed.stdin.flush()
            return listed.stdout.readline().strip()
        finally:
            listed.kill()

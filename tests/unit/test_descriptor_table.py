"""This process's descriptor table: its size under any name, and the kernel's /proc entries of closed numbers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from mme_runtime.base.descriptor_table import forget_closed_descriptors


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


def test_forgetting_closed_descriptors_frees_the_entries_a_listing_made_and_keeps_the_open_ones() -> None:
    # The JDK's launcher lists /proc/self/fd in each model's stub, and the kernel keeps an entry per number listed
    # until the stub is reaped in the UNLOAD's path. An entry still cached for a number closed and opened again keeps
    # its inode number; a freed one is made afresh, with a new one.
    closed, kept = 900, 901
    for fd in (closed, kept):
        os.dup2(1, fd)
    try:
        os.listdir("/proc/self/fd")  # what the launcher does
        before = {fd: os.stat(f"/proc/self/fd/{fd}", follow_symlinks=False).st_ino for fd in (closed, kept)}
        os.close(closed)
        forget_closed_descriptors()
        os.dup2(1, closed)
        after = {fd: os.stat(f"/proc/self/fd/{fd}", follow_symlinks=False).st_ino for fd in (closed, kept)}
    finally:
        for fd in (closed, kept):
            os.close(fd)
    assert after[closed] != before[closed]
    assert after[kept] == before[kept]

"""A runtime directory is one server's: a second server pointed at it is refused, naming the first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mme_runtime.base.errors import ConfigError
from mme_runtime.base.locks import hold_runtime_dir


def test_a_second_holder_of_a_runtime_directory_is_refused_naming_the_first(tmp_path: Path) -> None:
    fd = hold_runtime_dir(tmp_path / "run", 8080)
    try:
        with pytest.raises(ConfigError, match=rf"in use by another server \(pid {os.getpid()}, port 8080\)"):
            hold_runtime_dir(tmp_path / "run", 9000)
    finally:
        os.close(fd)
    os.close(hold_runtime_dir(tmp_path / "run", 9000))  # free once its holder let go


def test_a_holder_that_died_leaves_the_directory_free(tmp_path: Path) -> None:
    held = f"hold_runtime_dir(pathlib.Path({str(tmp_path)!r}), 1)"
    script = f"import os, pathlib; from mme_runtime.base.locks import hold_runtime_dir; {held}; os._exit(9)"
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    os.close(hold_runtime_dir(tmp_path, 8080))
    assert (tmp_path / "server.lock").read_text() == f"pid {os.getpid()}, port 8080\n"

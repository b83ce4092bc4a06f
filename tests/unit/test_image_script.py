"""scripts/test-image's build step: a build broken by buildah's own runtime runs once more, any other failure fails."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "test-image"
BUSY = "Close_Fd sealing memfd copy: Device or resource busy"


def load_script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("test_image_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = load_script()
    monkeypatch.setattr(module, "host_pip_settings", lambda: ([], []))
    monkeypatch.setattr(module, "provenance_args", lambda: [])
    return module


def fake_podman(bin_dir: Path, failures: list[str]) -> Path:
    """A `podman` that prints and fails with each of `failures` in turn, then succeeds; it counts its calls."""
    calls = bin_dir / "calls"
    script = ["#!/bin/sh", f'n=$(cat "{calls}" 2>/dev/null || echo 0); echo $((n + 1)) > "{calls}"']
    for index, message in enumerate(failures):
        script.append(f'if [ "$n" = {index} ]; then echo "STEP 16/23: RUN"; echo "{message}" >&2; exit 1; fi')
    script.append('echo "COMMIT"')
    podman = bin_dir / "podman"
    podman.write_text("\n".join(script) + "\n")
    podman.chmod(0o755)
    return calls


def path_env(bin_dir: Path) -> dict[str, str]:
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def test_a_build_broken_by_buildahs_runtime_is_built_once_more(
    script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = fake_podman(tmp_path, [BUSY])
    script.build_with_podman("localhost/x:t", "torch==2.13.0", path_env(tmp_path))
    assert calls.read_text().strip() == "2"
    out = capsys.readouterr().out
    assert BUSY in out  # the first build's output is shown as it came
    assert "building once more" in out


def test_a_build_that_fails_twice_in_buildahs_runtime_fails(script: ModuleType, tmp_path: Path) -> None:
    calls = fake_podman(tmp_path, [BUSY, BUSY])
    with pytest.raises(subprocess.CalledProcessError):
        script.build_with_podman("localhost/x:t", "torch==2.13.0", path_env(tmp_path))
    assert calls.read_text().strip() == "2"


def test_a_failing_dockerfile_fails_at_once(script: ModuleType, tmp_path: Path) -> None:
    calls = fake_podman(tmp_path, ["ERROR: No matching distribution found for nothing-such"])
    with pytest.raises(subprocess.CalledProcessError):
        script.build_with_podman("localhost/x:t", "torch==2.13.0", path_env(tmp_path))
    assert calls.read_text().strip() == "1"

"""The GPU proof's two scripts: the kit that travels to an air-gapped GPU host, and the proof that runs there.

The dry run (marked ``kit``) makes the kit as `make gpu-proof-kit` does, installs it into a fresh venv of torch,
transformers and scipy where pip can reach nothing else, and serves a model through the kit's own Java: it runs in
CI so the kit never rots between the rare GPU hosts.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> ModuleType:
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), str(SCRIPTS / name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # dataclasses look their module up
    loader.exec_module(module)
    return module


kit = load_script("gpu-proof-kit")
proof = load_script("gpu-proof")


def test_pins_are_read_from_requirements_with_names_in_their_normal_form(tmp_path: Path) -> None:
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("# a comment\nMulti_Model.Server==1.1.11\nmoto[server]==5.2.5\nsetuptools<81\n")
    assert kit.pins(requirements) == {"multi-model-server": "1.1.11", "moto": "5.2.5"}


def test_every_carried_package_is_pinned_by_the_server_s_requirements() -> None:
    wanted = kit.requirements()
    assert {line.split("==")[0] for line in wanted} >= set(kit.PINNED)
    assert all("==" in line for line in wanted)


def test_a_kit_too_large_for_the_lease_fails_naming_its_largest_parts(tmp_path: Path) -> None:
    made = tmp_path / "kit"
    (made / "wheels").mkdir(parents=True)
    (made / "wheels" / "big-1.0-py3-none-any.whl").write_bytes(b"\0" * (3 << 20))
    with pytest.raises(kit.KitError, match=r"(?s)pass 2.0 MiB together.*3\.0 MiB .*big-1\.0-py3-none-any\.whl"):
        kit.check_fits(made, 2.0)


def test_a_part_past_its_budget_is_reported_as_such_and_its_whole_tree_killed(tmp_path: Path) -> None:
    log = tmp_path / "logs.txt"
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "server.out").write_text("the server's last words\n")
    command = ["sh", "-c", "sleep 61.25 & wait"]  # a grandchild, in the part's session
    part = proof.Part("slow", "sleeps", 1, command, tmp_path / "work")
    proof.run_part(part, {}, log)
    assert part.status == "ran out of its 1 s" and not part.passed
    deadline = time.monotonic() + 10  # a killed process takes a moment to go
    while [path for path in Path("/proc").glob("[0-9]*/cmdline") if b"61.25" in read(path)]:
        assert time.monotonic() < deadline, "the part's grandchild outlived it"
        time.sleep(0.05)
    assert "the server's last words" in log.read_text()  # what a failed part's servers logged comes back


def read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # gone meanwhile
        return b""


def test_a_failing_part_fails_the_proof_and_a_passing_one_keeps_its_output(tmp_path: Path) -> None:
    log = tmp_path / "logs.txt"
    failing = proof.Part("broken", "exits 3", 10, ["sh", "-c", "echo why; exit 3"], tmp_path)
    passing = proof.Part("fine", "prints a table", 10, ["sh", "-c", "echo '| a | b |'"], tmp_path)
    for part in (failing, passing):
        proof.run_part(part, {}, log)
    assert failing.status == "failed (exit status 3)" and passing.passed
    report = proof.write_report(tmp_path, ["a fact"], [failing, passing], dry_run=False)
    assert "| broken | exits 3 | failed (exit status 3) |" in report and "| a | b |" in report


def test_every_part_the_proof_runs_can_be_named(tmp_path: Path) -> None:
    assert [part.name for part in proof.parts(tmp_path, tmp_path, dry_run=False)] == list(proof.PART_NAMES)


def test_no_kit_stops_the_proof_before_it_starts(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu-proof"), "--kit", str(tmp_path / "none"), str(tmp_path / "report")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "make gpu-proof-kit" in result.stderr


def test_the_card_s_tests_are_summed_up_from_their_junit_file(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite><testcase name="a"/><testcase name="b"><failure message="assert 1 &lt; 0&#10;more"/>'
        '</testcase><testcase name="c"><skipped message="no CUDA"/></testcase></testsuite></testsuites>'
    )
    assert proof.junit_summary(tmp_path / "junit.xml") == [
        "1 passed, 1 failed, 1 skipped",
        "- FAILED `b`: assert 1 < 0",
        "- skipped `c`: no CUDA",
    ]


@pytest.mark.kit
def test_the_kit_serves_a_model_from_a_venv_where_pip_reaches_nothing_else(tmp_path: Path) -> None:
    making = subprocess.Popen([str(SCRIPTS / "gpu-proof-kit"), "--out", str(tmp_path / "kit")], text=True)
    # Meanwhile the dry run's venv, made as --dry-run makes it: packing the kit's Java (xz) and installing torch take
    # about 10 and 15 s, on one core each.
    venv = tmp_path / "venv"
    try:
        proof.dry_run_venv(venv)
    finally:
        made = making.wait()
    assert made == 0
    started = time.monotonic()
    report = tmp_path / "report"
    dry = subprocess.run(
        [str(SCRIPTS / "gpu-proof"), "--dry-run", "--venv", str(venv), "--kit", str(tmp_path / "kit"), str(report)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert dry.returncode == 0, dry.stdout[-4000:] + dry.stderr[-4000:]
    text = (report / "report.md").read_text()
    assert "| smoke | serve one model through the carried Java | passed |" in text
    assert "LOAD to first answer" in text and "stopped by SIGTERM with exit status 0" in text
    print(f"dry run: {time.monotonic() - started:.0f} s")


def test_a_part_killed_leaves_the_processes_that_were_there_before_it(tmp_path: Path) -> None:
    bystander = subprocess.Popen(["sleep", "30"])  # the suite's moto server, say
    try:
        part = proof.Part("slow", "sleeps", 1, ["sh", "-c", "sleep 60.75 & wait"], tmp_path)
        proof.run_part(part, {}, tmp_path / "logs.txt")
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()

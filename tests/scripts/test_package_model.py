"""scripts/package_model.py: archive layout, determinism, refusals, and the upload to a real moto S3."""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path
from typing import Any

import boto3
import pytest
from _aws_cli import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, ScriptError, run_cli
from package_model import FIXED_MTIME, collect_entries, main, upload_destination

BUCKET = "mme-test-models"


def _write(path: Path, content: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)
    return path


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model directory as users lay it out: weights at the root, code/ beside them, plus a nested asset."""
    root = tmp_path / "resnet"
    _write(root / "model.pt", os.urandom(4096))
    _write(root / "config.json", '{"classes": 3}\n')
    _write(root / "assets" / "labels.txt", "cat\ndog\nbird\n")
    _write(root / "code" / "inference.py", "def model_fn(model_dir):\n    return None\n")
    _write(root / "code" / "requirements.txt", "numpy\n")
    (root / "code" / "run.sh").write_text("#!/bin/sh\n")
    (root / "code" / "run.sh").chmod(0o755)
    return root


def _files_under(root: Path) -> dict[str, bytes]:
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in root.rglob("*") if path.is_file()}


def _package(model_dir: Path, output: Path, *extra: str) -> int:
    return run_cli(main, [str(model_dir), "-o", str(output), *extra])


def test_archive_round_trips_artifacts_at_root_and_code_under_code(model_dir: Path, tmp_path: Path) -> None:
    archive = tmp_path / "out" / "resnet.tar.gz"
    assert _package(model_dir, archive) == EXIT_OK

    extracted = tmp_path / "extracted"
    with tarfile.open(archive) as tar:
        tar.extractall(extracted, filter="data")
    assert _files_under(extracted) == _files_under(model_dir)
    assert sorted(_files_under(extracted)) == [
        "assets/labels.txt",
        "code/inference.py",
        "code/requirements.txt",
        "code/run.sh",
        "config.json",
        "model.pt",
    ]


def test_archive_is_byte_identical_whatever_the_file_times(model_dir: Path, tmp_path: Path) -> None:
    first, second = tmp_path / "first.tar.gz", tmp_path / "second.tar.gz"
    assert _package(model_dir, first) == EXIT_OK
    for path in model_dir.rglob("*"):
        os.utime(path, (1_700_000_000, 1_700_000_000))
    assert _package(model_dir, second) == EXIT_OK
    assert hashlib.sha256(first.read_bytes()).digest() == hashlib.sha256(second.read_bytes()).digest()


def test_gzip_header_carries_the_fixed_time_and_no_file_name(model_dir: Path, tmp_path: Path) -> None:
    # Two runs within one second would agree even with the current time in the header: look at the header itself.
    archive = tmp_path / "resnet.tar.gz"
    assert _package(model_dir, archive) == EXIT_OK
    header = archive.read_bytes()[:10]
    assert header[:2] == b"\x1f\x8b"
    assert header[3] & 0x08 == 0  # FNAME flag: no original file name stored
    assert int.from_bytes(header[4:8], "little") == FIXED_MTIME


def test_members_are_sorted_with_fixed_time_owner_and_mode(model_dir: Path, tmp_path: Path) -> None:
    archive = tmp_path / "resnet.tar.gz"
    assert _package(model_dir, archive) == EXIT_OK
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
    names = [member.name for member in members]
    assert names == sorted(names)
    assert names.index("code") < names.index("code/inference.py")  # directories come before their contents
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(FIXED_MTIME, 0, 0, "", "")}
    modes = {member.name: member.mode for member in members}
    assert (modes["code"], modes["model.pt"], modes["code/run.sh"]) == (0o755, 0o644, 0o755)


def test_inference_and_requirements_options_land_under_code(tmp_path: Path) -> None:
    root = tmp_path / "weights-only"
    _write(root / "weights.bin", b"\x00\x01")
    script = _write(tmp_path / "src" / "my_handler.py", "def model_fn(model_dir):\n    return 1\n")
    requirements = _write(tmp_path / "src" / "reqs.txt", "scipy\n")

    entries = collect_entries(root, inference=script, requirements=requirements)

    assert entries == {
        "code/inference.py": script.resolve(),
        "code/requirements.txt": requirements.resolve(),
        "weights.bin": (root / "weights.bin").resolve(),
    }


def test_python_caches_are_left_out(model_dir: Path) -> None:
    _write(model_dir / "code" / "__pycache__" / "inference.cpython-311.pyc", b"cache")
    _write(model_dir / "code" / "helpers.pyc", b"cache")
    assert not [name for name in collect_entries(model_dir) if "pycache" in name or name.endswith(".pyc")]


def test_symlink_inside_the_directory_is_archived_as_its_content(model_dir: Path, tmp_path: Path) -> None:
    (model_dir / "model.pth").symlink_to("model.pt")
    (model_dir / "more-assets").symlink_to("assets", target_is_directory=True)
    entries = collect_entries(model_dir)
    assert entries["model.pth"] == (model_dir / "model.pt").resolve()
    assert entries["more-assets/labels.txt"] == (model_dir / "assets" / "labels.txt").resolve()


@pytest.mark.parametrize(
    ("link", "target", "message"),
    [
        ("secret.pt", "../outside/secret.pt", "leaves the model directory"),
        ("loop", ".", "loops back"),
        ("dangling.pt", "missing.pt", "broken symlink"),
    ],
)
def test_refuses_symlinks_that_leave_loop_or_dangle(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], link: str, target: str, message: str
) -> None:
    _write(tmp_path / "outside" / "secret.pt", b"not yours")
    (model_dir / link).symlink_to(target)
    archive = tmp_path / "resnet.tar.gz"

    assert _package(model_dir, archive) == EXIT_CONFIG

    assert message in capsys.readouterr().err
    assert not archive.exists()


def test_refuses_directory_without_model_file_or_entry_point(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "empty-model"
    _write(root / "README.md", "no weights here\n")

    assert _package(root, tmp_path / "empty.tar.gz") == EXIT_CONFIG

    err = capsys.readouterr().err
    assert "neither model.pt2 nor model.pt nor model.pth nor code/inference.py" in err
    assert len(err.strip().splitlines()) == 1  # one line, no traceback


def test_refuses_missing_directory_and_output_inside_it(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ScriptError, match="does not exist"):
        collect_entries(tmp_path / "nope")
    assert _package(model_dir, model_dir / "self.tar.gz") == EXIT_CONFIG
    assert not (model_dir / "self.tar.gz").exists()


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://bucket/mme/models/", ("bucket", "mme/models/resnet.tar.gz")),
        ("s3://bucket/mme/models", ("bucket", "mme/models/resnet.tar.gz")),
        ("s3://bucket", ("bucket", "resnet.tar.gz")),
        ("s3://bucket/exact/name.tar.gz", ("bucket", "exact/name.tar.gz")),
    ],
)
def test_upload_destination_treats_non_archive_keys_as_prefixes(uri: str, expected: tuple[str, str]) -> None:
    assert upload_destination(uri, "resnet.tar.gz") == expected


def test_upload_puts_the_archive_in_moto_s3(
    aws: str, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=BUCKET)
    archive = tmp_path / "resnet.tar.gz"

    assert _package(model_dir, archive, "--upload", f"s3://{BUCKET}/mme/models/") == EXIT_OK

    stored = s3.get_object(Bucket=BUCKET, Key="mme/models/resnet.tar.gz")["Body"].read()
    assert stored == archive.read_bytes()
    assert f"uploaded s3://{BUCKET}/mme/models/resnet.tar.gz" in capsys.readouterr().out


def test_upload_to_a_missing_bucket_fails_with_one_line(
    aws: str, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _package(model_dir, tmp_path / "resnet.tar.gz", "--upload", "s3://no-such-bucket/models/") == EXIT_FAILURE
    err = capsys.readouterr().err
    assert "s3://no-such-bucket/models/resnet.tar.gz failed" in err
    assert "NoSuchBucket" in err


def test_upload_without_credentials_says_so_and_exits_2(
    no_aws_credentials: None, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _package(model_dir, tmp_path / "resnet.tar.gz", "--upload", f"s3://{BUCKET}/") == EXIT_CONFIG
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: no AWS credentials found: run `aws configure`, set AWS_PROFILE, or export AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY"
    ]


NET_FACTORY = """
import torch


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
"""


def _unpacked_pt2(archive: Path, destination: Path) -> Path:
    with tarfile.open(archive) as tar:
        member = tar.extractfile("model.pt2")
        assert member is not None
        (destination / "model.pt2").write_bytes(member.read())
    return destination / "model.pt2"


@pytest.mark.parametrize("aot", [False, True], ids=["exported", "aot-cpu"])
def test_a_module_factory_ships_as_a_pt2_the_container_serves_with_no_code(tmp_path: Path, aot: bool) -> None:
    import torch

    from mme_runtime.base.errors import InvalidInput
    from mme_runtime.models import pt2

    factory = tmp_path / "net.py"
    factory.write_text(NET_FACTORY)
    model_dir = tmp_path / "net"
    model_dir.mkdir()
    archive = tmp_path / "net.tar.gz"
    argv = [str(model_dir), "-o", str(archive), "--module", f"{factory}:build", "--example", "1,4"]

    assert run_cli(main, [*argv, "--aot", "cpu"] if aot else argv) == EXIT_OK

    path = _unpacked_pt2(archive, tmp_path)
    assert pt2.kind(path) == ("aoti" if aot else "exported_program")
    loaded = pt2.load(path)
    model = loaded.place(torch.device("cpu")) if aot else loaded
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    rows = torch.randn(5, 4)  # any number of rows: the first dimension was exported dynamic
    with torch.inference_mode():
        torch.testing.assert_close(model(rows), eager(rows))
        torch.testing.assert_close(model(rows[:1]), eager(rows[:1]))
        # Rows of another width: the exported program checks its inputs; the package records them and the server
        # checks for it (compiled code would read past the end of the input).
        refusal: Any = InvalidInput if aot else (RuntimeError, AssertionError)
        with pytest.raises(refusal, match="shape|size|dim"):
            model(torch.randn(2, 5))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--aot", "cpu"], "--aot compiles a model.pt2"),
        (["--module", "nowhere.py:build", "--example", "1,4"], "must be FILE.py:FUNCTION naming an existing file"),
        (["--example", "1,4"], "--example goes with --module"),
        (["--example", "1,x"], "must be a shape like 1,3,224,224"),
    ],
)
def test_bad_pt2_options_exit_2_with_one_line(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert run_cli(main, [str(model_dir), "-o", str(tmp_path / "out.tar.gz"), *extra]) == EXIT_CONFIG
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_the_archive_lands_in_the_current_directory_readable_by_others_and_the_path_is_printed(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    previous = os.umask(0o022)
    try:
        assert run_cli(main, [str(model_dir)]) == EXIT_OK
    finally:
        os.umask(previous)
    archive = work / "resnet.tar.gz"
    assert archive.stat().st_mode & 0o777 == 0o644
    assert f"wrote {archive.resolve()} (" in capsys.readouterr().out

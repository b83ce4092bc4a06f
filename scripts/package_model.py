#!/usr/bin/env python3
"""Packages a model directory as a SageMaker model.tar.gz, and optionally uploads it to S3.

The archive holds the directory's files at its root (model.pt2, model.pt, model.pth, ...) and the
inference code under code/ (inference.py, optional requirements.txt), the layout SageMaker unpacks
into /opt/ml/models/<name>/model.
The same inputs always give the same bytes: entries are sorted and carry a fixed time, owner and
mode. __pycache__ directories and *.pyc files are left out. Symlinks are followed only while they
stay inside the model directory.

PyTorch 2: --module FILE.py:FUNCTION builds an nn.Module, exports it with torch.export (traced on a
random input of --example's shape, its first dimension dynamic) and ships it as model.pt2; --aot cpu
compiles the model.pt2 (from --module or the directory) into an AOTInductor package for CPU hosts.
Both are served with no code.

examples:
  scripts/package_model.py models/resnet                      # writes ./resnet.tar.gz
  scripts/package_model.py models/resnet --module net.py:build --example 1,3,224,224 --aot cpu
  scripts/package_model.py models/resnet -o dist/resnet.tar.gz --inference src/inference.py
  scripts/package_model.py models/resnet --upload s3://my-bucket/mme/models/
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import sys
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from _aws_cli import EXIT_OK, ScriptError, boto_session, config_error, parse_s3_uri, run_cli
from _pt2_packaging import PT2_FILE, aot_compile, export_module, parse_example
from boto3.exceptions import S3UploadFailedError
from botocore.client import BaseClient

MODEL_FILES = ("model.pt2", "model.pt", "model.pth")
ENTRY_POINT = "code/inference.py"
REQUIREMENTS = "code/requirements.txt"
ARCHIVE_SUFFIX = ".tar.gz"
# 1980-01-01, the earliest time a zip can hold: what reproducible wheels use, and unlike 0 no tool
# mistakes it for "unset".
FIXED_MTIME = 315532800
# Interpreter caches differ per Python version and per run; shipping them would break byte-for-byte
# equality.
SKIPPED_DIRS = frozenset({"__pycache__"})
SKIPPED_SUFFIXES = (".pyc",)
# gzip's default level 9 takes much longer on multi-GB weights and saves almost nothing on float
# data.
COMPRESS_LEVEL = 6


def _resolve_inside(link: Path, root: Path) -> Path:
    """The target of ``link``, provided it stays under ``root`` (already resolved)."""
    try:
        target = link.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop, on Python 3.11 and 3.12
        raise config_error(f"broken symlink {link}: {exc}") from exc
    if not target.is_relative_to(root):
        raise config_error(
            f"refusing symlink {link} -> {target}: it leaves the model directory {root}"
        )
    return target


def _collect_files(
    directory: Path, root: Path, prefix: str, ancestors: frozenset[Path]
) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for child in sorted(directory.iterdir(), key=lambda path: path.name):
        if child.name in SKIPPED_DIRS or child.name.endswith(SKIPPED_SUFFIXES):
            continue
        arcname = prefix + child.name
        target = _resolve_inside(child, root) if child.is_symlink() else child
        if target.is_dir():
            real = target.resolve()
            if real in ancestors:
                raise config_error(f"refusing symlink {child}: it loops back to {real}")
            files.update(_collect_files(target, root, arcname + "/", ancestors | {real}))
        elif target.is_file():
            files[arcname] = target
        else:
            raise config_error(f"{child} is neither a regular file nor a directory")
    return files


def _explicit_file(path: Path, option: str) -> Path:
    if not path.is_file():
        raise config_error(f"{option} {path}: no such file")
    return path.resolve()


def collect_entries(
    model_dir: Path,
    inference: Path | None = None,
    requirements: Path | None = None,
    pt2: Path | None = None,
) -> dict[str, Path]:
    """Maps each archive name to the file that provides it.

    ``inference`` and ``requirements`` are files the user names on the command line, so they may
    live anywhere; they replace ``code/inference.py`` and ``code/requirements.txt`` from the
    directory.
    """
    if not model_dir.is_dir():
        raise config_error(f"model directory {model_dir} does not exist or is not a directory")
    root = model_dir.resolve()
    entries = _collect_files(root, root, "", frozenset({root}))
    if inference is not None:
        entries[ENTRY_POINT] = _explicit_file(inference, "--inference")
    if requirements is not None:
        entries[REQUIREMENTS] = _explicit_file(requirements, "--requirements")
    if pt2 is not None:
        entries[PT2_FILE] = pt2  # made by --module or --aot: replaces the directory's
    validate_entries(entries, model_dir)
    return entries


def validate_entries(entries: Mapping[str, Path], model_dir: Path) -> None:
    """Refuses an archive that the container could not load a model from."""
    if ENTRY_POINT in entries or any(name in entries for name in MODEL_FILES):
        return
    raise config_error(
        f"{model_dir} has neither {' nor '.join(MODEL_FILES)} nor {ENTRY_POINT}: the container "
        "would have nothing to load (add the model file, or pass --inference with a script that "
        "defines model_fn)"
    )


def _directories(names: Sequence[str]) -> set[str]:
    """Every parent directory of ``names``, so that extracting creates them with a known mode."""
    parents: set[str] = set()
    for name in names:
        parts = name.split("/")[:-1]
        parents.update("/".join(parts[: index + 1]) for index in range(len(parts)))
    return parents


def _tar_info(name: str, source: Path | None) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mtime = FIXED_MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if source is None:
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
    else:
        info.size = source.stat().st_size
        info.mode = 0o755 if os.access(source, os.X_OK) else 0o644
    return info


def write_archive(entries: Mapping[str, Path], output: Path) -> None:
    """Writes the gzipped tar to ``output`` through a temporary file, so a failure never leaves half
    an archive."""
    output.parent.mkdir(parents=True, exist_ok=True)
    members: dict[str, Path | None] = {name: None for name in _directories(list(entries))}
    members.update(entries)
    handle, tmp_name = tempfile.mkstemp(prefix=f".{output.name}.", dir=output.parent)
    try:
        # GzipFile writes the file name and the current time into its header unless told otherwise.
        with (
            os.fdopen(handle, "wb") as raw,
            gzip.GzipFile(
                filename="", mode="wb", fileobj=raw, mtime=FIXED_MTIME, compresslevel=COMPRESS_LEVEL
            ) as gz,
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            for name in sorted(members):
                source = members[name]
                if source is None:
                    tar.addfile(_tar_info(name, None))
                else:
                    with source.open("rb") as data:
                        tar.addfile(_tar_info(name, source), data)
        # mkstemp makes it 0600: an archive is for others to read and upload
        os.chmod(tmp_name, 0o666 & ~_umask())
        os.replace(tmp_name, output)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_output_location(model_dir: Path, output: Path) -> None:
    if output.resolve().is_relative_to(model_dir.resolve()):
        raise config_error(
            f"output {output} is inside the model directory: the archive would contain itself"
        )
    if not output.name.endswith(ARCHIVE_SUFFIX):
        raise config_error(
            f"output {output} must end with {ARCHIVE_SUFFIX}: multi-model endpoints load only those"
        )


def upload_destination(s3_uri: str, archive_name: str) -> tuple[str, str]:
    """Bucket and key: a URI ending in .tar.gz is the key itself, anything else is a prefix for the
    archive."""
    bucket, key = parse_s3_uri(s3_uri)
    if key.endswith(ARCHIVE_SUFFIX):
        return bucket, key
    if key and not key.endswith("/"):
        key += "/"
    return bucket, key + archive_name


def upload_archive(s3: BaseClient, archive: Path, bucket: str, key: str) -> str:
    try:
        s3.upload_file(str(archive), bucket, key)
    except S3UploadFailedError as exc:
        # boto3 wraps NoSuchBucket, AccessDenied, ... in this one type
        raise ScriptError(f"upload of {archive} to s3://{bucket}/{key} failed: {exc}") from exc
    return f"s3://{bucket}/{key}"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="package_model.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model_dir", type=Path, help="directory with the artifacts and, optionally, code/"
    )
    parser.add_argument(
        "-o", "--output", type=Path, help="archive to write (default: ./<model_dir name>.tar.gz)"
    )
    parser.add_argument(
        "--inference",
        type=Path,
        help="script to ship as code/inference.py (replaces the directory's)",
    )
    parser.add_argument("--requirements", type=Path, help="file to ship as code/requirements.txt")
    parser.add_argument(
        "--upload",
        metavar="S3_URI",
        help="upload to this prefix (s3://bucket/prefix/) or exact key (s3://bucket/key.tar.gz)",
    )
    parser.add_argument(
        "--region", help="AWS region for --upload (default: the AWS configuration's)"
    )
    parser.add_argument(
        "--module", metavar="FILE.py:FUNCTION", help="export this nn.Module factory as model.pt2"
    )
    parser.add_argument(
        "--example", type=parse_example, help="input shape to trace --module with, e.g. 1,3,224,224"
    )
    parser.add_argument(
        "--aot",
        choices=["cpu"],
        help="compile model.pt2 ahead of time (AOTInductor) for this device",
    )
    return parser


def _pt2(args: argparse.Namespace, scratch: Path) -> Path | None:
    """The model.pt2 that --module and --aot make (in ``scratch``), or None when neither is asked
    for."""
    if args.module is None and args.aot is None:
        if args.example is not None:
            raise config_error("--example goes with --module")
        return None
    source: Path = args.model_dir / PT2_FILE
    if args.module is not None:
        if args.example is None:
            raise config_error("--module needs --example, the input shape to trace it with")
        source = export_module(args.module, args.example, scratch / "exported.pt2")
    elif not source.is_file():
        raise config_error(
            f"--aot compiles a model.pt2: {args.model_dir} has none (pass --module to make one)"
        )
    if args.aot is None:
        return source
    return aot_compile(source, scratch / "compiled.pt2")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    output: Path = args.output or Path(args.model_dir.resolve().name + ARCHIVE_SUFFIX)
    check_output_location(args.model_dir, output)
    with tempfile.TemporaryDirectory(prefix="package-model-") as scratch:
        entries = collect_entries(
            args.model_dir, args.inference, args.requirements, pt2=_pt2(args, Path(scratch))
        )
        write_archive(entries, output)
    print(
        f"wrote {output.resolve()} ({len(entries)} files, {output.stat().st_size} bytes, sha256 "
        f"{sha256_of(output)})"
    )
    if args.upload:
        bucket, key = upload_destination(args.upload, output.name)
        uri = upload_archive(boto_session(args.region).client("s3"), output, bucket, key)
        print(f"uploaded {uri}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(run_cli(main))

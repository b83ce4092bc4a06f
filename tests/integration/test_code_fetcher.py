"""CodeFetcher against a real S3 server: every failure names the URI and the cause, in bounded time."""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import model_factory
import pytest
from ports import free_port
from s3_server import S3Server, start_s3

from mme_runtime.models.code_fetcher import CodeFetcher, CodeFetchError

BUCKET = "fetch"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with start_s3(tmp_path_factory.mktemp("moto")) as server:
        server.client().create_bucket(Bucket=BUCKET)
        yield server


def fetcher(s3: S3Server, cache: Path) -> CodeFetcher:
    return CodeFetcher(cache, timeout_seconds=5, client=s3.client())


def put(s3: S3Server, key: str, data: bytes) -> str:
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=data)
    return f"s3://{BUCKET}/{key}"


def archive(entries: list[tarfile.TarInfo]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for entry in entries:
            tar.addfile(entry, io.BytesIO(b"x" * entry.size) if entry.isfile() else None)
    return buffer.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = 1 if kind == tarfile.REGTYPE else 0
    return info


def test_fetch_extracts_once_and_reuses_by_etag(s3: S3Server, tmp_path: Path) -> None:
    uri = put(s3, "ok.tar.gz", model_factory.code_archive(tmp_path / "a.tar.gz", "one").read_bytes())
    first = fetcher(s3, tmp_path / "cache").fetch(uri)
    assert (first / "inference.py").is_file()
    assert fetcher(s3, tmp_path / "cache").fetch(uri) == first
    assert s3.requests_for("GET", BUCKET, "ok.tar.gz") == 1


@pytest.mark.parametrize(
    ("entries", "cause"),
    [
        ([entry("/etc/evil")], "absolute path"),
        ([entry("a/../../evil")], "contains '..'"),
        ([entry("link", tarfile.SYMTYPE, "../../../../etc/passwd")], "leaves it"),
        ([entry("hard", tarfile.LNKTYPE, "/etc/passwd")], "leaves it"),
        ([entry("fifo", tarfile.FIFOTYPE)], "device or pipe"),
    ],
    ids=["absolute", "dotdot", "symlink", "hardlink", "fifo"],
)
def test_unsafe_entries_are_refused_and_nothing_is_left(
    s3: S3Server, tmp_path: Path, entries: list[tarfile.TarInfo], cause: str
) -> None:
    uri = put(s3, "evil.tar.gz", archive([entry("inference.py"), *entries]))
    with pytest.raises(CodeFetchError) as error:
        fetcher(s3, tmp_path / "cache").fetch(uri)
    assert uri in str(error.value) and cause in str(error.value)
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.parametrize(
    ("uri", "cause"),
    [
        (f"s3://{BUCKET}/absent.tar.gz", "no such key"),
        ("s3://no-such-bucket-anywhere/code.tar.gz", "no such"),
        ("http://example.com/code.tar.gz", "not an s3://bucket/key URI"),
    ],
)
def test_missing_objects_and_bad_uris_name_the_cause(s3: S3Server, tmp_path: Path, uri: str, cause: str) -> None:
    with pytest.raises(CodeFetchError) as error:
        fetcher(s3, tmp_path).fetch(uri)
    assert uri in str(error.value) and cause in str(error.value)


def test_corrupt_archive_is_refused(s3: S3Server, tmp_path: Path) -> None:
    uri = put(s3, "corrupt.tar.gz", b"\x1f\x8bnot really gzip")
    with pytest.raises(CodeFetchError, match="not a readable tar archive"):
        fetcher(s3, tmp_path / "cache").fetch(uri)
    assert [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_access_denied_is_reported(tmp_path: Path) -> None:
    # With authentication enforced (after the first few set-up calls), unknown keys are refused with 403.
    with start_s3(tmp_path, {"INITIAL_NO_AUTH_ACTION_COUNT": "2"}) as locked:
        locked.client().create_bucket(Bucket=BUCKET)
        locked.client().put_object(Bucket=BUCKET, Key="k.tar.gz", Body=b"x")
        client = boto3.client(
            "s3",
            endpoint_url=locked.url,
            region_name="us-east-1",
            aws_access_key_id="unknown",
            aws_secret_access_key="unknown",
        )
        with pytest.raises(CodeFetchError, match="access denied"):
            CodeFetcher(tmp_path / "cache", client=client).fetch(f"s3://{BUCKET}/k.tar.gz")


def test_unreachable_endpoint_fails_within_bounded_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    started = time.monotonic()
    with pytest.raises(CodeFetchError, match="cannot reach the S3 endpoint"):
        CodeFetcher(tmp_path, timeout_seconds=5).fetch(f"s3://{BUCKET}/k.tar.gz")
    assert time.monotonic() - started < 30


def test_code_in_s3_without_the_aws_sdk_fails_its_load_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mme_runtime.models import code_fetcher

    monkeypatch.setattr(code_fetcher, "boto3", None)  # a Python without it, as the GPU proof's kit leaves it
    with pytest.raises(CodeFetchError, match="fetching code from S3 needs boto3, which this Python does not have"):
        CodeFetcher(tmp_path).fetch("s3://bucket/code.tar.gz")

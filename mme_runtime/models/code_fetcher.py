"""Inference code from ``s3://bucket/key.tar.gz``: fetched once per container, cached by URI and
ETag, unpacked safely.

A HEAD per load tells whether the cached copy is current; the GET happens only when the ETag is new,
under a file lock, into a temporary directory that is renamed into place, so a failure never leaves
a half-written entry.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tarfile
import time
from pathlib import Path
from typing import Any

try:  # the AWS SDK: only a model whose code lives in S3 needs it (the GPU proof's kit carries none)
    import boto3
    from botocore.config import Config as BotoConfig
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectTimeoutError,
        EndpointConnectionError,
        ReadTimeoutError,
    )
except ImportError:  # every name above is used only after ``CodeFetcher.client`` made a client
    boto3 = None

from mme_runtime.base import failures
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.base.locks import build_once
from mme_runtime.operations import metrics

logger = logging.getLogger(__name__)

S3_URI = re.compile(r"^s3://(?P<bucket>[^/]+)/(?P<key>.+)$")
READ_CHUNK = 1024 * 1024
ATTEMPTS = 2  # each S3 call's, timed out after MME_S3_TIMEOUT_SECONDS


class CodeFetchError(ModelLoadError):
    """The code archive could not be fetched or unpacked; the message names the URI and the
    cause."""


def locate_code(
    model_dir: Path, submit_directory: str | None, fetcher: CodeFetcher
) -> tuple[Path | None, str]:
    """Where a model's inference code is: its ``code/``, else ``SAGEMAKER_SUBMIT_DIRECTORY``, else
    none (defaults).

    Returns the directory (or None) and a description for the log line that says which was bound.
    """
    own = model_dir / "code"
    if own.is_dir():
        return own, f"{own}"
    if submit_directory:
        if submit_directory.startswith("s3://"):
            return fetcher.fetch(submit_directory), submit_directory
        local = Path(submit_directory)
        if not local.is_dir():
            raise CodeFetchError(
                f"SAGEMAKER_SUBMIT_DIRECTORY={submit_directory}: no such directory"
            )
        return local, str(local)
    return None, "defaults"


def parse_s3_uri(uri: str) -> tuple[str, str]:
    match = S3_URI.match(uri)
    if match is None:
        raise CodeFetchError(f"{uri}: not an s3://bucket/key URI")
    return match["bucket"], match["key"]


class CodeFetcher:
    """Fetches and caches code archives under ``cache_dir`` (shared by every process of the
    container)."""

    def __init__(self, cache_dir: Path, timeout_seconds: int = 30, client: Any = None) -> None:
        self.cache_dir = cache_dir
        self._timeout = timeout_seconds
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            if boto3 is None:
                raise CodeFetchError(
                    "fetching code from S3 needs boto3, which this Python does not have"
                )
            # boto3 finds credentials and a custom endpoint (AWS_ENDPOINT_URL_S3) by itself.
            config = BotoConfig(
                connect_timeout=min(5, self._timeout),
                read_timeout=self._timeout,
                retries={"max_attempts": ATTEMPTS, "mode": "standard"},
            )
            self._client = boto3.session.Session().client("s3", config=config)
        return self._client

    def fetch(self, uri: str) -> Path:
        """The directory holding the archive's contents, fetching it only if this ETag is not cached
        yet."""
        started = time.monotonic()
        try:
            return self._fetch(uri)
        except CodeFetchError as exc:
            if boto3 is None or not isinstance(
                exc.__cause__, (ReadTimeoutError, ConnectTimeoutError)
            ):
                raise
            setting = f"MME_S3_TIMEOUT_SECONDS={self._timeout} per call, {ATTEMPTS} attempts"
            message = failures.timed_out(time.monotonic() - started, setting, f"fetching {uri}")
            raise CodeFetchError(message) from exc.__cause__

    def _fetch(self, uri: str) -> Path:
        bucket, key = parse_s3_uri(uri)
        etag = self._etag(uri, bucket, key)
        entry = self.cache_dir / _entry_name(uri, etag)
        built = build_once(
            entry, lambda staging: self._download_and_extract(uri, bucket, key, etag, staging)
        )
        metrics.record_cache_lookup("code", hit=not built)
        if built:
            logger.info("code %s etag=%s fetched to %s", uri, etag, entry)
        else:
            logger.info("code %s etag=%s cached at %s", uri, etag, entry)
        return entry

    def _etag(self, uri: str, bucket: str, key: str) -> str:
        client = self.client
        try:
            head = client.head_object(Bucket=bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            raise CodeFetchError(f"{uri}: {_describe(exc)}") from exc
        return str(head["ETag"]).strip('"')

    def _download_and_extract(
        self, uri: str, bucket: str, key: str, etag: str, staging: Path
    ) -> Path:
        archive = staging / "archive"
        client = self.client
        try:
            body = client.get_object(Bucket=bucket, Key=key, IfMatch=etag)["Body"]
            with open(archive, "wb") as out:
                for chunk in iter(lambda: body.read(READ_CHUNK), b""):
                    out.write(chunk)
        except (ClientError, BotoCoreError) as exc:
            raise CodeFetchError(f"{uri}: {_describe(exc)}") from exc
        extract_archive(archive, staging / "code", uri)
        return staging / "code"


def extract_archive(archive: Path, target: Path, uri: str) -> None:
    """Unpacks a tar archive, refusing absolute paths, ``..``, links leaving ``target`` and special
    files."""
    target.mkdir(parents=True)
    try:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                _check_member(member, target, uri)
            # The "data" filter re-checks all of the above and strips unsafe modes (PEP 706).
            tar.extractall(target, filter="data")
    except tarfile.FilterError as exc:
        raise CodeFetchError(f"{uri}: unsafe archive entry refused: {exc}") from exc
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise CodeFetchError(
            f"{uri}: not a readable tar archive ({type(exc).__name__}: {exc})"
        ) from exc


def _check_member(member: tarfile.TarInfo, target: Path, uri: str) -> None:
    name = member.name
    if name.startswith("/") or Path(name).is_absolute():
        raise CodeFetchError(f"{uri}: unsafe archive entry refused: absolute path {name!r}")
    if ".." in Path(name).parts:
        raise CodeFetchError(f"{uri}: unsafe archive entry refused: {name!r} contains '..'")
    if member.issym() or member.islnk():
        base = target if member.islnk() else (target / name).parent
        destination = (base / member.linkname).resolve()
        if not destination.is_relative_to(target.resolve()):
            raise CodeFetchError(
                f"{uri}: unsafe archive entry refused: link {name!r} -> {member.linkname!r} leaves "
                "it"
            )
    elif not (member.isfile() or member.isdir()):
        raise CodeFetchError(f"{uri}: unsafe archive entry refused: {name!r} is a device or pipe")


def _entry_name(uri: str, etag: str) -> str:
    return hashlib.sha256(f"{uri}\0{etag}".encode()).hexdigest()[:24]


def _describe(exc: Exception) -> str:
    """A one-line cause a user can act on."""
    if isinstance(exc, EndpointConnectionError):
        return f"cannot reach the S3 endpoint ({exc})"
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("404", "NoSuchKey", "NotFound"):
            return "no such key (or no such bucket)"
        if code == "NoSuchBucket":
            return "no such bucket"
        if code in ("403", "AccessDenied", "Forbidden"):
            return "access denied"
        if code in ("412", "PreconditionFailed"):
            return "the object changed while it was fetched; retry the LOAD"
        return f"S3 answered {status} {code}"
    return f"{type(exc).__name__}: {exc}"

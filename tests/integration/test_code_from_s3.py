"""Inference code from S3 on demand and per-model requirements, with the real MMS and a real S3 server (moto)."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import model_factory
import pytest
from s3_server import S3Server, start_s3
from serving import RunningServer, start_server, wait_until

BUCKET = "code"
KEY = "mme/code.tar.gz"
URI = f"s3://{BUCKET}/{KEY}"
ROWS = json.dumps([[1.0, 2.0, 3.0, 4.0]])


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with start_s3(tmp_path_factory.mktemp("moto")) as server:
        server.client().create_bucket(Bucket=BUCKET)
        yield server


def upload(s3: S3Server, path: Path, key: str = KEY) -> None:
    s3.client().upload_file(str(path), BUCKET, key)


@pytest.fixture(scope="module")
def server(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("s3code")
    upload(s3, model_factory.code_archive(home / "v1.tar.gz", "v1"))
    env = {**s3.env, "SAGEMAKER_SUBMIT_DIRECTORY": URI, "MME_CACHE_DIR": str(home / "cache")}
    with start_server(home, env) as running:
        yield running


def version_of(server: RunningServer, name: str) -> str:
    response = server.invoke(name, ROWS)
    assert response.status_code == 200, response.text
    return str(response.json()["version"])


def test_model_without_code_is_served_by_code_from_s3(server: RunningServer) -> None:
    model_factory.torchscript_model(server.model_dir("plain"))
    assert server.load("plain").status_code == 200
    assert version_of(server, "plain") == "v1"
    assert wait_until(lambda: f"code={URI}" in server.log_text(), 5)


def test_a_model_with_its_own_code_keeps_it(server: RunningServer) -> None:
    model_factory.transform_model(server.model_dir("own"))
    assert server.load("own").status_code == 200
    assert server.invoke("own", ROWS).headers["Content-Type"] == "application/vnd.argmax+json"


def test_new_object_version_is_picked_up_on_the_next_load(s3: S3Server, server: RunningServer) -> None:
    model_factory.torchscript_model(server.model_dir("before"))
    assert server.load("before").status_code == 200
    gets = s3.requests_for("GET", BUCKET, KEY)

    upload(s3, model_factory.code_archive(server.home / "v2.tar.gz", "v2"))
    model_factory.torchscript_model(server.model_dir("after"))
    assert server.load("after").status_code == 200

    assert version_of(server, "after") == "v2"
    assert version_of(server, "before") in ("v1", "v2")  # loaded earlier; its code stays what it imported
    assert s3.requests_for("GET", BUCKET, KEY) == gets + 1
    # Same ETag again: the cached copy is reused, only a HEAD is paid, once: the loader resolves the LOAD's code
    # and its device host takes what it resolved.
    heads = s3.requests_for("HEAD", BUCKET, KEY)
    model_factory.torchscript_model(server.model_dir("again"))
    assert server.load("again").status_code == 200
    assert version_of(server, "again") == "v2"
    assert s3.requests_for("GET", BUCKET, KEY) == gets + 1
    assert s3.requests_for("HEAD", BUCKET, KEY) == heads + 1


def malicious_archive(path: Path, escape: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        data = b"def model_fn(model_dir):\n    return None\n"
        info = tarfile.TarInfo("inference.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        evil = tarfile.TarInfo(f"../../../../../../../..{escape}")
        evil.size = 4
        tar.addfile(evil, io.BytesIO(b"pwnd"))
    return path


def test_malicious_archive_is_refused_and_nothing_escapes(s3: S3Server, server: RunningServer) -> None:
    escape = server.home / "escaped.txt"
    upload(s3, malicious_archive(server.home / "evil.tar.gz", escape))  # replaces the server's code archive
    model_factory.torchscript_model(server.model_dir("evil"))
    try:
        response = server.load("evil")
        assert response.status_code == 500
        assert wait_until(lambda: "unsafe archive entry refused" in server.log_text(), 5)
        assert URI in server.log_text()
        assert not escape.exists()
        cache = server.home / "cache" / "code"
        assert not [p for p in cache.iterdir() if p.name.startswith(".partial-")]
    finally:
        upload(s3, model_factory.code_archive(server.home / "v3.tar.gz", "v3"))
    assert server.invoke("plain", ROWS).status_code == 200  # the rest keeps serving


def remove_object(s3: S3Server, home: Path) -> None:
    s3.client().delete_object(Bucket=BUCKET, Key=KEY)


def upload_garbage(s3: S3Server, home: Path) -> None:
    garbage = home / "garbage.tar.gz"
    garbage.write_bytes(b"\x1f\x8b this is not gzip")
    upload(s3, garbage)


@pytest.mark.parametrize(
    ("name", "break_object", "cause"),
    [("missing", remove_object, "no such key"), ("corrupt", upload_garbage, "not a readable tar archive")],
)
def test_a_broken_code_object_fails_the_load_naming_uri_and_cause(
    s3: S3Server, server: RunningServer, name: str, break_object: Callable[[S3Server, Path], None], cause: str
) -> None:
    break_object(s3, server.home)
    model_factory.torchscript_model(server.model_dir(name))
    try:
        assert server.load(name).status_code == 500
        assert wait_until(lambda: f"{URI}: {cause}" in server.log_text(), 5)
    finally:
        upload(s3, model_factory.code_archive(server.home / f"restored-{name}.tar.gz", "restored"))


def test_three_workers_and_two_models_loading_at_once_fetch_once(s3: S3Server, tmp_path: Path) -> None:
    key = "mme/shared.tar.gz"
    upload(s3, model_factory.code_archive(tmp_path / "shared.tar.gz", "shared"), key=key)
    env = {
        **s3.env,
        "SAGEMAKER_SUBMIT_DIRECTORY": f"s3://{BUCKET}/{key}",
        "MME_CACHE_DIR": str(tmp_path / "cache"),
        "SAGEMAKER_MODEL_SERVER_WORKERS": "3",
        # Each model's loader fetches, in a device host of its own: two processes race for the archive.
        "MME_SHARE_DEVICE": "false",
    }
    with start_server(tmp_path, env) as server:
        for name in ("first", "second"):
            model_factory.torchscript_model(server.model_dir(name))
        with ThreadPoolExecutor(2) as pool:
            loads = list(pool.map(server.load, ["first", "second"]))
        assert [r.status_code for r in loads] == [200, 200]
        assert version_of(server, "first") == version_of(server, "second") == "shared"
        assert s3.requests_for("GET", BUCKET, key) == 1
        assert s3.requests_for("HEAD", BUCKET, key) == 2  # one per LOAD: its loader's, handed to its host


def test_requirements_are_installed_and_imported(tmp_path: Path) -> None:
    with start_server(tmp_path, {"MME_CACHE_DIR": str(tmp_path / "cache")}) as server:
        model_dir = model_factory.torchscript_model(server.model_dir("needs"))
        model_factory.write_code(model_dir, "inflection==0.5.1\n", name="requirements.txt")
        model_factory.write_code(
            model_dir,
            """
            import json

            import inflection


            def model_fn(model_dir):
                return None


            def transform_fn(model, body, content_type, accept):
                return json.dumps({"word": inflection.pluralize("model"), "from": inflection.__file__})
            """,
        )
        assert server.load("needs").status_code == 200
        answer = server.invoke("needs", b"{}").json()
        assert answer["word"] == "models"
        assert answer["from"].startswith(str(tmp_path / "cache" / "requirements"))

        broken = model_factory.torchscript_model(server.model_dir("broken"))
        model_factory.write_code(broken, "mme-gpu-no-such-package-xyz==1.0\n", name="requirements.txt")
        assert server.load("broken").status_code == 500
        assert wait_until(lambda: "load failed status=500: pip install -r " in server.log_text(), 5)
        assert "mme-gpu-no-such-package-xyz" in server.log_text()
        assert server.invoke("needs", b"{}").status_code == 200  # other models keep serving

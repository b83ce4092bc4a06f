"""A LoRA adapter whose base is an archive on S3 (``base_model=s3://...``), through the real frontend and a real S3
server (moto): fetched once, loaded once for every adapter, each adapter answering as PEFT's merged model; a base
archive that is not there fails the LOAD with the cause in the log."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path

import lora_models
import pytest
import torch
from s3_server import S3Server, start_s3
from serving import RunningServer, label_scores, start_server

BUCKET = "bases"
URI = f"s3://{BUCKET}/bert.tar.gz"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lora_models.base(tmp_path_factory.mktemp("base") / "bert")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory, base: Path) -> Iterator[S3Server]:
    archive = tmp_path_factory.mktemp("archive") / "bert.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(base, arcname="bert")  # the model as one directory of the archive
    with start_s3(tmp_path_factory.mktemp("moto")) as server:
        server.client().create_bucket(Bucket=BUCKET)
        server.client().upload_file(str(archive), BUCKET, "bert.tar.gz")
        yield server


@pytest.fixture(scope="module")
def server(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("s3-base")
    with start_server(home, {**s3.env, "MME_CACHE_DIR": str(home / "cache")}) as running:
        yield running


def test_adapters_over_a_base_on_s3_answer_as_peft_merged(server: RunningServer, base: Path) -> None:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(base))
    for index in range(2):
        adapter = lora_models.adapter(base, server.models / f"s3-adapter-{index}", seed=index)
        (adapter / "serving.properties").write_text(f"base_model={URI}\n")
        response = server.load(f"s3-adapter-{index}")
        assert response.status_code == 200, server.log_text()[-3000:]
        with torch.inference_mode():
            logits = lora_models.merged(base, adapter)(**tokenizer("good movie", return_tensors="pt")).logits[0]
        expected = sorted(torch.softmax(logits, dim=-1).tolist())
        assert label_scores(server, f"s3-adapter-{index}", "good movie") == pytest.approx(expected, abs=1e-4)
    log = server.log_text()
    assert f"code {URI} etag=" in log and "shares its package" in log  # fetched, and loaded once for both


def test_a_base_archive_that_is_not_there_fails_the_load_with_the_cause(server: RunningServer, base: Path) -> None:
    adapter = lora_models.adapter(base, server.models / "orphan", seed=5)
    (adapter / "serving.properties").write_text(f"base_model=s3://{BUCKET}/missing.tar.gz\n")
    assert server.load("orphan").status_code >= 400
    assert f"s3://{BUCKET}/missing.tar.gz" in server.log_text()

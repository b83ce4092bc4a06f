"""A re-LOAD after UNLOAD (what SageMaker does when a model it evicted is asked for again) through the real frontend:
the package kept since the UNLOAD serves it with no loader and no ``model_fn``, answering as before; a changed file,
or ``MME_KEEP_UNLOADED_MB=0``, runs ``model_fn`` again. The keeping itself is tests/unit/test_package_cache.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import model_factory
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families
from s3_server import start_s3
from serving import RunningServer, borrowed, start_server, wait_until

ROWS = json.dumps([[1.0, 2.0, 3.0, 4.0], [0.5, 0.0, -1.0, 2.0]])

# The AWS-style state-dict model (model_factory.STATE_DICT_SCRIPT) with each call of its model_fn counted in a file
# outside the model's directory (a file written inside it would change the directory, and so its key).
COUNTED_SCRIPT = (
    model_factory.STATE_DICT_SCRIPT
    + """

_load = model_fn


def model_fn(model_dir):
    with open(os.environ["MME_TEST_MODEL_FN_CALLS"], "a") as calls:
        calls.write(f"{os.getpid()}\\n")
    return _load(model_dir)
"""
)
INPUTS = json.dumps({"inputs": json.loads(ROWS)})  # what the state-dict script's input_fn reads


def counted_model(model_dir: Path, seed: int) -> Path:
    model_dir.mkdir(parents=True)
    torch.save(model_factory.tiny_net(seed).state_dict(), model_dir / "model.pth")
    model_factory.write_code(model_dir, COUNTED_SCRIPT)
    return model_dir


def model_fn_calls(home: Path) -> int:
    calls = home / "model_fn_calls"
    return len(calls.read_text().split()) if calls.exists() else 0


def load_and_answer(server: RunningServer, name: str, model_dir: Path) -> list[list[float]]:
    """A counted model's LOAD, then its predictions for ``INPUTS``."""
    assert server.load(name, model_dir).status_code == 200, server.log_text()[-2000:]
    response = server.invoke(name, INPUTS)
    assert response.status_code == 200, response.text
    return list(response.json()["predictions"])


def load_seconds(server: RunningServer) -> dict[str, float]:
    """``mme_model_load_seconds`` of each loaded model, from ``/metrics``."""
    text = requests.get(server.metrics_url, timeout=10).text
    families = text_string_to_metric_families(text)
    return {s.labels["model"]: s.value for f in families for s in f.samples if s.name == "mme_model_load_seconds"}


def test_a_model_loaded_again_after_its_unload_skips_model_fn_and_answers_as_before(tmp_path: Path) -> None:
    with start_server(tmp_path, {"MME_TEST_MODEL_FN_CALLS": str(tmp_path / "model_fn_calls")}) as server:
        model_dir = counted_model(server.model_dir("counted"), seed=3)
        other_dir = counted_model(server.model_dir("other"), seed=4)
        first = load_and_answer(server, "counted", model_dir)
        other = load_and_answer(server, "other", other_dir)
        assert first != other and model_fn_calls(tmp_path) == 2
        for name in ("counted", "other"):
            assert server.unload(name).status_code == 200

        assert load_and_answer(server, "counted", model_dir) == first
        assert load_and_answer(server, "other", other_dir) == other  # each name its own package, in any order
        # Each model's own LOAD time, from the warm process's start of its LOAD to ready in its host.
        assert wait_until(lambda: load_seconds(server).keys() == {"counted", "other"}, 10), load_seconds(server)
        assert all(0 < seconds < 60 for seconds in load_seconds(server).values())
        assert model_fn_calls(tmp_path) == 2
        log = server.log_text()
        assert "model=counted takes its package, kept since its UNLOAD" in log
        assert log.count("model=counted packed seconds=") == 1  # the loader ran once

        # Another name for the same files runs its own model_fn: user code may read its name.
        load_and_answer(server, "renamed", model_dir)
        assert model_fn_calls(tmp_path) == 3

        # New weights in the same directory: the kept package is not theirs.
        assert server.unload("counted").status_code == 200
        torch.save(model_factory.tiny_net(5).state_dict(), model_dir / "model.pth")
        assert load_and_answer(server, "counted", model_dir) != first
        assert model_fn_calls(tmp_path) == 4


def test_with_keeping_off_a_re_load_runs_model_fn_again(tmp_path: Path) -> None:
    env = {"MME_TEST_MODEL_FN_CALLS": str(tmp_path / "model_fn_calls"), "MME_KEEP_UNLOADED_MB": "0"}
    with start_server(tmp_path, env) as server:
        model_dir = counted_model(server.model_dir("counted"), seed=3)
        first = load_and_answer(server, "counted", model_dir)
        assert server.unload("counted").status_code == 200
        assert load_and_answer(server, "counted", model_dir) == first
        assert model_fn_calls(tmp_path) == 2
        assert "kept since its UNLOAD" not in server.log_text()


def test_a_kept_package_made_with_older_code_from_s3_is_not_used(tmp_path: Path) -> None:
    """Code from SAGEMAKER_SUBMIT_DIRECTORY's S3 URI: a re-LOAD takes the kept package, with no loader and no GET;
    after a new object at that URI, the device host finds the code changed and runs the new model_fn itself."""
    uri = "s3://code/mme/code.tar.gz"
    (tmp_path / "moto").mkdir()
    with start_s3(tmp_path / "moto") as s3:
        s3.client().create_bucket(Bucket="code")
        s3.client().upload_file(
            str(model_factory.code_archive(tmp_path / "v1.tar.gz", "v1")), "code", "mme/code.tar.gz"
        )
        env = {**s3.env, "SAGEMAKER_SUBMIT_DIRECTORY": uri, "MME_CACHE_DIR": str(tmp_path / "cache")}
        with start_server(tmp_path / "home", env) as server:
            model_dir = model_factory.torchscript_model(server.model_dir("m"))

            def reload_version() -> str:
                assert server.load("m", model_dir).status_code == 200, server.log_text()[-2000:]
                response = server.invoke("m", ROWS)
                assert response.status_code == 200, response.text
                assert server.unload("m").status_code == 200
                return str(response.json()["version"])

            assert [reload_version(), reload_version()] == ["v1", "v1"]
            log = server.log_text()
            assert log.count("model=m packed seconds=") == 1  # its loader ran once, at the first LOAD
            assert len(re.findall(f"code {uri} etag=\\S+ fetched to", log)) == 1
            assert "model=m takes its package, kept since its UNLOAD" in log

            s3.client().upload_file(
                str(model_factory.code_archive(tmp_path / "v2.tar.gz", "v2")), "code", "mme/code.tar.gz"
            )
            assert reload_version() == "v2"
            assert "its package's was" in server.log_text() and "model_fn runs here" in server.log_text()
            # The stale package was dropped, not kept: the next re-LOAD runs the loader with v2, then keeps that.
            assert [reload_version(), reload_version()] == ["v2", "v2"]
            log = server.log_text()
            assert log.count("model_fn runs here") == 1 and log.count("model=m packed seconds=") == 2


def test_a_torchscript_model_with_a_code_directory_but_no_script_is_loaded_once(shared_server: RunningServer) -> None:
    """A code/ with only a requirements.txt: the host finds it as the loader did, and takes the package."""
    with borrowed(shared_server) as server:
        model_dir = model_factory.torchscript_model(server.model_dir("reload-ts"))
        (model_dir / "code").mkdir()
        (model_dir / "code" / "requirements.txt").write_text("torch\n")
        for _ in range(2):
            assert server.load("reload-ts", model_dir).status_code == 200
            assert server.invoke("reload-ts", ROWS).status_code == 200
            assert server.unload("reload-ts").status_code == 200
        log = server.log_text()
        assert "model_fn runs here" not in log and "model=reload-ts takes its package, kept since its UNLOAD" in log

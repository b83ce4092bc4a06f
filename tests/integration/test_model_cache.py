"""The warm process's model cache for isolated models (MME_SHARE_DEVICE=false): shared across names, released on
UNLOAD, bounded, least recently used out. Models that share a device host share packages instead
(test_device_host.py)."""

from __future__ import annotations

import json
from pathlib import Path

import model_factory
import torch
from serving import start_server, wait_until

ROWS = json.dumps([[1.0, 2.0, 3.0, 4.0]])
ISOLATED = {"MME_SHARE_DEVICE": "false"}


def mlp_model(model_dir: Path, size_mb: int) -> Path:
    """A TorchScript MLP of about ``size_mb`` MiB taking rows of 4 numbers."""
    width = 1024
    layers = max(1, size_mb * 2**20 // (4 * width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), *[torch.nn.Linear(width, width) for _ in range(layers)])
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.jit.script(model.eval()).save(str(model_dir / "model.pt"))
    return model_dir


def test_same_artifacts_under_two_names_load_once_and_are_released_on_unload(tmp_path: Path) -> None:
    with start_server(tmp_path, ISOLATED) as server:
        model_dir = model_factory.torchscript_model(server.model_dir("artifacts"))
        assert server.load("first", model_dir).status_code == 200
        assert server.load("second", model_dir).status_code == 200
        answers = [server.invoke(name, ROWS).json() for name in ("first", "second")]
        assert answers[0] == answers[1]
        log = server.log_text()
        assert log.count("model cache loaded") == 1 and log.count("model cache hit") == 1

        assert server.unload("first").status_code == 200
        assert server.invoke("second", ROWS).json() == answers[0]  # still shared, still served
        assert "model cache released" not in server.log_text()
        assert server.unload("second").status_code == 200
        assert wait_until(lambda: "model cache released" in server.log_text(), 10)

        # Released means read from disk again on the next LOAD.
        assert server.load("third", model_dir).status_code == 200
        assert server.invoke("third", ROWS).json() == answers[0]
        assert server.log_text().count("model cache loaded") == 2


def test_cache_is_bounded_and_evicts_the_least_recently_used(tmp_path: Path) -> None:
    with start_server(tmp_path, {**ISOLATED, "MME_MODEL_CACHE_MB": "20"}) as server:
        big = mlp_model(server.model_dir("big"), 32)
        small_a = mlp_model(server.model_dir("a"), 12)
        small_b = mlp_model(server.model_dir("b"), 12)
        assert server.load("big", big).status_code == 200  # too big to cache: served all the same
        assert wait_until(lambda: "does not fit in 20 MiB" in server.log_text(), 5)
        assert server.invoke("big", ROWS).status_code == 200

        assert server.load("a", small_a).status_code == 200
        assert server.load("b", small_b).status_code == 200  # 12 + 12 > 20: a, least recently used, goes
        assert wait_until(lambda: f"model cache released {small_a.resolve() / 'model.pt'}" in server.log_text(), 5)
        assert server.load("a-again", small_a).status_code == 200  # a is loaded again (and b makes way)
        log = server.log_text()
        assert log.count(f"model cache loaded {small_a / 'model.pt'}") == 2
        for name in ("big", "a", "b", "a-again"):
            assert server.invoke(name, ROWS).status_code == 200


def test_models_with_their_own_code_are_never_cached(tmp_path: Path) -> None:
    with start_server(tmp_path) as server:
        model_factory.state_dict_model(server.model_dir("scripted"))
        model_factory.transform_model(server.model_dir("transform"))
        assert server.load("scripted").status_code == 200
        assert server.load("transform").status_code == 200
        assert "model cache" not in server.log_text()

"""``compile=true`` through the real MMS frontend: an AOTInductor compile per device at LOAD, kept in the compile
cache so that the same artifacts load compiled without compiling again (another name, or after a restart), and
eager serving with the reason in the log whenever a model cannot be compiled."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import model_factory
import numpy as np
import pytest
import torch
from serving import RunningServer, borrowed, npy, start_server, wait_until

ROWS = [[0.5, -1.0, 2.0, 0.25], [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 1.0, 1.0]]


def compiled_model(model_dir: Path) -> None:
    """The AWS-style state-dict model (its own input_fn takes {"inputs": ...}) with a sample and compile=true."""
    model_factory.state_dict_model(model_dir)
    (model_dir / "code" / "warmup.json").write_text(json.dumps({"inputs": [[1.0, 2.0, 3.0, 4.0]]}))
    (model_dir / "serving.properties").write_text("compile=true\n")


def expected(rows: list[list[float]]) -> np.ndarray:
    with torch.inference_mode():
        return model_factory.tiny_net(0)(torch.tensor(rows)).numpy()


def load_seconds(server: RunningServer, name: str) -> float:
    started = time.monotonic()
    response = server.load(name)
    assert response.status_code == 200, response.text
    return time.monotonic() - started


def compile_lines(server: RunningServer, name: str) -> list[str]:
    return re.findall(rf"model={name} compiled for cpu mode=default ([a-z ,]+) seconds", server.log_text())


def test_compile_once_then_load_compiled_from_the_cache_under_another_name_and_after_a_restart(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    env = {"MME_CACHE_DIR": str(cache)}
    with start_server(tmp_path / "first", env) as server:
        compiled_model(server.model_dir("fresh"))
        first = load_seconds(server, "fresh")
        response = server.invoke("fresh", json.dumps({"inputs": ROWS}))
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(np.array(response.json()["predictions"]), expected(ROWS), rtol=1e-4, atol=1e-6)
        assert compile_lines(server, "fresh") == ["compiled now, stored in the cache"]

        shutil.copytree(server.model_dir("fresh"), server.model_dir("again"))
        second = load_seconds(server, "again")
        assert compile_lines(server, "again") == ["loaded from the compile cache"]
        assert second < first  # the compile itself is what the cache saves
        response = server.invoke("again", json.dumps({"inputs": ROWS[:1]}))
        np.testing.assert_allclose(np.array(response.json()["predictions"]), expected(ROWS[:1]), rtol=1e-4, atol=1e-6)

    with start_server(tmp_path / "restarted", env) as server:
        compiled_model(server.model_dir("restarted"))
        load_seconds(server, "restarted")
        assert compile_lines(server, "restarted") == ["loaded from the compile cache"]
        assert server.invoke("restarted", json.dumps({"inputs": ROWS})).status_code == 200


@pytest.fixture(scope="module")
def server(shared_server: RunningServer) -> Iterator[RunningServer]:
    with borrowed(shared_server) as running:
        yield running


def test_a_model_that_cannot_be_compiled_is_served_eager_with_the_reason(server: RunningServer) -> None:
    model_dir = model_factory.torchscript_model(server.model_dir("scripted"))
    model_factory.write_code(model_dir, "", name="warmup.json").write_text(json.dumps([[1.0, 2.0, 3.0, 4.0]]))
    (model_dir / "serving.properties").write_text("compile=true\n")

    assert server.load("scripted").status_code == 200

    response = server.invoke("scripted", json.dumps(ROWS))
    assert response.status_code == 200
    np.testing.assert_allclose(np.array(response.json()), expected(ROWS), rtol=1e-5)
    assert wait_until(
        lambda: (
            "model=scripted compile=true: serving eager, not compiled: it is a RecursiveScriptModule"
            in server.log_text()
        ),
        5,
    )


def test_compile_without_a_sample_serves_eager_and_says_what_it_needs(server: RunningServer) -> None:
    model_dir = model_factory.state_dict_model(server.model_dir("no_sample"))
    (model_dir / "serving.properties").write_text("compile=true\n")

    assert server.load("no_sample").status_code == 200

    assert server.invoke("no_sample", json.dumps({"inputs": ROWS})).status_code == 200
    assert "model=no_sample compile=true: serving eager, not compiled: compiling needs a sample" in server.log_text()


UNTRACEABLE_SCRIPT = """
import torch


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        if x.sum() > 0:  # a branch on the data: torch.export cannot trace it
            return self.fc(x)
        return -self.fc(x)


def model_fn(model_dir):
    torch.manual_seed(0)
    return Branchy().eval()
"""


def test_a_compile_that_fails_falls_back_to_eager_and_serves(server: RunningServer) -> None:
    model_dir = server.model_dir("branchy")
    model_factory.write_code(model_dir, UNTRACEABLE_SCRIPT)
    (model_dir / "code" / "warmup.json").write_text(json.dumps([[1.0, 2.0, 3.0, 4.0]]))
    (model_dir / "serving.properties").write_text("compile=true\n")

    assert server.load("branchy").status_code == 200

    assert server.invoke("branchy", json.dumps([[1.0, 1.0, 1.0, 1.0]])).status_code == 200
    assert "model=branchy compile=true: serving eager, not compiled: " in server.log_text()


def test_a_compiled_model_gives_inputs_it_was_not_traced_for_to_the_eager_module(server: RunningServer) -> None:
    """Compiled for float32 rows of 4 (the sample), whose code checks nothing: other inputs go to the eager module,
    which answers them as it would without compile=true (here: a float64 request is refused with 400)."""
    model_dir = server.model_dir("typed")
    model = model_factory.pt2_model(model_dir, "mlp")
    (model_dir / "code").mkdir()
    (model_dir / "code" / "warmup.json").write_text(json.dumps([[1.0, 2.0, 3.0, 4.0]]))
    (model_dir / "serving.properties").write_text("compile=true\n")
    assert server.load("typed").status_code == 200
    assert "model=typed compiled for cpu" in server.log_text()

    refused = server.invoke("typed", npy(np.array(ROWS, dtype=np.float64)), content_type="application/x-npy")
    answered = server.invoke("typed", json.dumps(ROWS))

    assert refused.status_code == 400, refused.text
    assert answered.status_code == 200, answered.text
    with torch.inference_mode():
        want = model(torch.tensor(ROWS)).numpy()
    np.testing.assert_allclose(np.array(answered.json()), want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def compiled_in_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny net's directory and a compile cache holding its compiled package (compiled here, once)."""
    from mme_runtime.models.pt2 import compile_model

    root = tmp_path_factory.mktemp("compiled")
    model_dir = root / "model"
    model_factory.torchscript_model(model_dir)  # the directory's content keys the cache
    compile_model(*_compile_arguments(model_dir, root / "cache"))
    return model_dir, root / "cache"


def _compile_arguments(model_dir: Path, cache: Path) -> tuple[object, ...]:
    from mme_runtime.models.serving_properties import ServingSettings

    settings = ServingSettings(4, 10, "serving.properties", compile=True)
    sample = torch.tensor(ROWS[:2])
    return (model_factory.tiny_net(0), "m", model_dir, torch.device("cpu"), settings, sample, cache)


def test_a_compiled_model_converted_after_the_compile_runs_eager_and_right(
    compiled_in_process: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    from mme_runtime.models.pt2 import CompiledModule, compile_model

    model_dir, cache = compiled_in_process
    compiled = compile_model(*_compile_arguments(model_dir, cache))
    assert isinstance(compiled, CompiledModule) and compiled.runner is not None
    with torch.inference_mode():
        np.testing.assert_allclose(compiled(torch.tensor(ROWS)).numpy(), expected(ROWS), rtol=1e-5, atol=1e-6)
        compiled.to("cpu")  # where it is already: still compiled
        assert compiled.runner is not None
        compiled.share_memory()  # new storage, same dtype, shape and layout: the compiled code follows it
        assert compiled.runner is not None
        np.testing.assert_allclose(compiled(torch.tensor(ROWS)).numpy(), expected(ROWS), rtol=1e-5, atol=1e-6)
        compiled.double()  # the compiled code was built for float32 tensors: it must not read float64 ones
        assert compiled.runner is None
        answer = compiled(torch.tensor(ROWS, dtype=torch.float64))
    assert answer.dtype == torch.float64
    np.testing.assert_allclose(answer.numpy(), expected(ROWS), rtol=1e-5, atol=1e-6)
    assert "runs eager from now on" in caplog.text


def test_a_damaged_compile_cache_entry_is_compiled_again(
    compiled_in_process: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    from mme_runtime.models.pt2 import CompiledModule, compile_model

    model_dir, cache = compiled_in_process
    [package] = list((cache / "compiled").glob("*/model.pt2"))
    package.write_bytes(b"not a package any more")
    compiled = compile_model(*_compile_arguments(model_dir, cache))
    assert isinstance(compiled, CompiledModule) and compiled.runner is not None
    assert "unusable" in caplog.text and "compiling again" in caplog.text
    with torch.inference_mode():
        np.testing.assert_allclose(compiled(torch.tensor(ROWS)).numpy(), expected(ROWS), rtol=1e-5, atol=1e-6)

"""PyTorch 2 artifacts with no code, through the real MMS frontend: ``model.pt2`` as a torch.export program or as an
AOTInductor package (compiled here for the CPU), alone and batched, and archives that cannot be served."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import model_factory
import numpy as np
import pytest
import torch
from serving import RunningServer, borrowed, npy, wait_until

KINDS = {"exported": False, "aoti": True}


@pytest.fixture(scope="module")
def server(shared_server: RunningServer) -> Iterator[RunningServer]:
    with borrowed(shared_server) as running:
        yield running


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, torch.nn.Module]]:
    """Each net in each kind, built once (an AOTInductor compile takes seconds)."""
    root = tmp_path_factory.mktemp("pt2-artifacts")
    built = {}
    for net in ("mlp", "conv"):
        for kind, aoti in KINDS.items():
            directory = root / f"{net}-{kind}"
            built[(net, kind)] = (directory, model_factory.pt2_model(directory, net, aoti=aoti))
    return built


def install(server: RunningServer, name: str, source: Path, batch_size: int | None = None) -> Path:
    model_dir = server.model_dir(name)
    model_dir.mkdir(parents=True)
    (model_dir / "model.pt2").hardlink_to(source / "model.pt2")
    if batch_size is not None:
        (model_dir / "serving.properties").write_text(f"batch_size={batch_size}\nmax_batch_delay=20\n")
    return model_dir


def expected(model: torch.nn.Module, inputs: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.from_numpy(inputs)).numpy()


def request_for(net: str, rows: int, generator: np.random.Generator) -> np.ndarray:
    shape = (rows, model_factory.IN_FEATURES) if net == "mlp" else (rows, 3, 16, 16)
    return generator.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("net", ["mlp", "conv"])
def test_zero_code_pt2_answers_what_eager_pytorch_answers(
    server: RunningServer, artifacts: dict[tuple[str, str], tuple[Path, torch.nn.Module]], net: str, kind: str
) -> None:
    source, model = artifacts[(net, kind)]
    name = f"{net}-{kind}"
    install(server, name, source)
    response = server.load(name)
    assert response.status_code == 200, response.text
    generator = np.random.default_rng(1)

    for rows in (1, 3, 5):  # a dynamic batch dimension: any number of rows
        inputs = request_for(net, rows, generator)
        answer = server.invoke(name, npy(inputs), content_type="application/x-npy", accept="application/x-npy")
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(np.load(io.BytesIO(answer.content)), expected(model, inputs), rtol=1e-4, atol=1e-5)
    if kind == "aoti":
        assert "AOTInductor package, loaded on each device by its device host" in server.log_text()


@pytest.mark.parametrize("kind", list(KINDS))
def test_zero_code_pt2_batches_concurrent_requests_and_each_gets_its_rows(
    server: RunningServer, artifacts: dict[tuple[str, str], tuple[Path, torch.nn.Module]], kind: str
) -> None:
    source, model = artifacts[("mlp", kind)]
    name = f"batched-{kind}"
    install(server, name, source, batch_size=8)
    assert server.load(name).status_code == 200
    assert wait_until(lambda: len(server.describe(name).json()["workers"]) == 8, 30)
    generator = random.Random(5)
    bodies = [
        [[generator.uniform(-2, 2) for _ in range(model_factory.IN_FEATURES)] for _ in range(generator.randint(1, 3))]
        for _ in range(48)
    ]

    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda rows: server.invoke(name, json.dumps(rows)), bodies))

    for rows, response in zip(bodies, responses, strict=True):
        assert response.status_code == 200, response.text
        want = expected(model, np.array(rows, dtype=np.float32))
        np.testing.assert_allclose(np.array(response.json()), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "content", "cause"),
    [
        ("corrupt", b"\x00not an archive at all" * 10, "model.pt2 is not a PT2 archive"),
        ("torchscript", None, "model.pt2 is not a PT2 archive"),
    ],
)
def test_a_pt2_that_is_not_an_exported_program_or_a_package_fails_the_load_with_the_cause(
    server: RunningServer, name: str, content: bytes | None, cause: str
) -> None:
    model_dir = server.model_dir(f"bad-{name}")
    if content is None:  # a TorchScript file under the new name: a zip archive, but not a PT2 one
        model_factory.torchscript_model(model_dir)
        (model_dir / "model.pt").rename(model_dir / "model.pt2")
    else:
        model_dir.mkdir(parents=True)
        (model_dir / "model.pt2").write_bytes(content)

    response = server.load(f"bad-{name}")

    assert response.status_code == 500
    assert wait_until(lambda: cause in server.log_text(), 5)
    # MMS unregisters a model whose LOAD failed a moment after it answered (as in test_reliability)
    assert wait_until(lambda: server.describe(f"bad-{name}").status_code == 404, 10)


def test_loading_a_package_never_imports_the_compiler(
    artifacts: dict[tuple[str, str], tuple[Path, torch.nn.Module]],
) -> None:
    """Serving compiled code must not pay for torch._inductor's import (1.5 s of every LOAD on a CPU host)."""
    source, model = artifacts[("conv", "aoti")]
    inputs = request_for("conv", 2, np.random.default_rng(3))
    script = (
        "import sys, numpy, torch\n"
        "from pathlib import Path\n"
        "from mme_runtime.models import pt2\n"
        f"runner = pt2.load(Path({str(source / 'model.pt2')!r})).place(torch.device('cpu'))\n"
        f"print(runner(torch.from_numpy(numpy.load({str(source / 'inputs.npy')!r}))).tolist())\n"
        "print([m for m in ('torch._inductor', 'torch._dynamo') if m in sys.modules])\n"
    )
    np.save(source / "inputs.npy", inputs)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    answer, imported = result.stdout.splitlines()[-2:]
    np.testing.assert_allclose(np.array(json.loads(answer)), expected(model, inputs), rtol=1e-4, atol=1e-5)
    assert imported == "[]"


def test_the_warm_process_imports_the_pt2_loader_once_for_every_later_model(
    server: RunningServer, artifacts: dict[tuple[str, str], tuple[Path, torch.nn.Module]]
) -> None:
    for index in range(2):
        name = f"warm-{index}"
        install(server, name, artifacts[("mlp", "exported")][0])
        assert server.load(name).status_code == 200
    # The whole log, not this module's part of it: another module may have loaded a PT2 model first.
    assert server.log.read_text(errors="replace").count("warm process: PyTorch 2 loader imported") == 1


@pytest.mark.parametrize(
    ("shape", "dtype"), [((2, 3, 8, 8), np.float32), ((2, 1, 16, 16), np.float32), ((2, 3, 16, 16), np.float64)]
)
def test_an_aoti_package_refuses_rows_it_was_not_compiled_for(
    server: RunningServer,
    artifacts: dict[tuple[str, str], tuple[Path, torch.nn.Module]],
    shape: tuple[int, ...],
    dtype: type,
) -> None:
    """Compiled code reads its input as laid out at compile time and checks nothing: the server checks, and says."""
    name = "conv-aoti-checked"
    if server.describe(name).status_code == 404:
        install(server, name, artifacts[("conv", "aoti")][0])
        assert server.load(name).status_code == 200
    inputs = np.random.default_rng(5).standard_normal(shape).astype(dtype)
    answer = server.invoke(name, npy(inputs), content_type="application/x-npy", accept="application/json")
    assert answer.status_code == 400, answer.text
    assert "takes rows of shape [3, 16, 16]" in answer.json()["message"]

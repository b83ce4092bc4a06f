"""The decoder families people serve, as tiny models built here: a bfloat16 checkpoint loads as bfloat16 and computes
in float32 on the CPU."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import hf_models
import pytest
import torch

from mme_runtime.huggingface import loading as hf_loading

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """Each (family, dtype)'s model directory, built once for the module."""
    root = tmp_path_factory.mktemp("decoder-families")
    made: dict[tuple[str, str], Path] = {}

    def build(family: str, dtype: str) -> Path:
        if (family, dtype) not in made:
            made[family, dtype] = hf_models.decoder(root / f"{family}-{dtype}", family, dtype)
        return made[family, dtype]

    return build


def test_a_bfloat16_checkpoint_loads_as_bfloat16_and_computes_in_float32_on_the_cpu(
    built: Callable[[str, str], Path], tmp_path: Path
) -> None:
    directory = built("llama", "bfloat16")
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = hf_loading.load(directory, "text-generation", trust_remote_code=False)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16  # transformers 5 reads dtype="auto"
    assert {parameter.dtype for parameter in loaded.place(CPU).model.parameters()} == {torch.float32}
    # transformers 4's key, as older checkpoints have it, is honoured too
    older = hf_models.decoder(tmp_path / "older", "llama", "bfloat16")
    config = json.loads((older / "config.json").read_text())
    config["torch_dtype"] = config.pop("dtype")
    (older / "config.json").write_text(json.dumps(config))
    assert next(hf_loading.load(older, "text-generation", False).model.parameters()).dtype == torch.bfloat16

"""LoRA adapters over one base, row by row: a pass that mixes adapters gives each row what PEFT's merged model gives it
alone, and an adapter this server cannot serve, or whose base is not there, fails its LOAD with the reason (400)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lora_models
import pytest
import torch

from mme_runtime.base.errors import ModelLoadError
from mme_runtime.models import lora, lora_layers


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("lora")
    base = lora_models.base(root / "base")
    adapters = [lora_models.adapter(base, root / f"adapter-{seed}", seed=seed) for seed in range(3)]
    return base, adapters


def base_module(base: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForSequenceClassification.from_pretrained(str(base)).eval()


class Holder:
    adapters = None


def test_a_pass_that_mixes_adapters_answers_each_row_as_peft_merged(made: tuple[Path, list[Path]]) -> None:
    base, adapter_dirs = made
    module, holder = base_module(base), Holder()
    for index, directory in enumerate(adapter_dirs):
        lora_layers.attach(holder, module, f"a{index}", lora.read_adapter(directory))
    torch.manual_seed(0)
    ids = torch.randint(5, 300, (6, 12))
    names: list[str | None] = ["a0", "a1", "a2", None, "a1", "a0"]

    with torch.inference_mode(), holder.adapters.selecting(names):
        mixed = module(input_ids=ids).logits

    with torch.inference_mode():
        for row, name in enumerate(names):
            reference = base_module(base) if name is None else lora_models.merged(base, adapter_dirs[int(name[1])])
            torch.testing.assert_close(mixed[row], reference(input_ids=ids[row : row + 1]).logits[0], atol=1e-4, rtol=0)


def test_an_adapter_that_leaves_takes_its_tensors_and_no_others(made: tuple[Path, list[Path]]) -> None:
    base, adapter_dirs = made
    module, holder = base_module(base), Holder()
    lora_layers.attach(holder, module, "a0", lora.read_adapter(adapter_dirs[0]))
    lora_layers.attach(holder, module, "a1", lora.read_adapter(adapter_dirs[1]))
    assert holder.adapters.remove("a0") == 1
    ids = torch.randint(5, 300, (1, 8))
    with torch.inference_mode(), holder.adapters.selecting(["a1"]):
        ours = module(input_ids=ids).logits
    with torch.inference_mode():
        torch.testing.assert_close(
            ours, lora_models.merged(base, adapter_dirs[1])(input_ids=ids).logits, atol=1e-4, rtol=0
        )


def test_rslora_and_rank_patterns_scale_as_peft_does(made: tuple[Path, list[Path]], tmp_path: Path) -> None:
    base, _ = made
    directory = lora_models.adapter(base, tmp_path / "rs", seed=7, use_rslora=True, rank_pattern={"value": 4})
    module, holder = base_module(base), Holder()
    lora_layers.attach(holder, module, "rs", lora.read_adapter(directory))
    ids = torch.randint(5, 300, (2, 10))
    with torch.inference_mode(), holder.adapters.selecting(["rs", "rs"]):
        ours = module(input_ids=ids).logits
    with torch.inference_mode():
        torch.testing.assert_close(ours, lora_models.merged(base, directory)(input_ids=ids).logits, atol=1e-4, rtol=0)


def rewrite_config(directory: Path, **changes: object) -> None:
    path = directory / lora.CONFIG_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"peft_type": "IA3"}, "only LORA adapters"),
        ({"use_dora": True}, "use_dora=True is not served"),
        ({"bias": "all"}, "bias='all' is not served"),
    ],
)
def test_an_adapter_this_server_cannot_serve_is_refused_with_the_reason(
    made: tuple[Path, list[Path]], tmp_path: Path, changes: dict[str, object], reason: str
) -> None:
    directory = Path(shutil.copytree(made[1][0], tmp_path / "changed"))
    rewrite_config(directory, **changes)
    with pytest.raises(ModelLoadError, match=reason):
        lora.read_adapter(directory)


def test_a_head_of_another_shape_is_refused_naming_what_to_fix(made: tuple[Path, list[Path]], tmp_path: Path) -> None:
    import transformers

    base, _ = made
    other = tmp_path / "other-base"  # the same base, with a head of five labels
    config = transformers.AutoConfig.from_pretrained(str(base), num_labels=5)
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(other)
    directory = lora_models.adapter(other, tmp_path / "five-labels", seed=1)
    with pytest.raises(ModelLoadError, match="num_labels") as raised:
        lora_layers.attach(Holder(), base_module(base), "five", lora.read_adapter(directory))
    assert raised.value.status == 400


def test_the_base_is_the_setting_or_the_one_directory_inside(made: tuple[Path, list[Path]], tmp_path: Path) -> None:
    base, adapter_dirs = made
    root = base.parent
    assert lora.base_directory(adapter_dirs[0], "../base", root) == base.resolve()
    with pytest.raises(ModelLoadError, match="outside the model root") as outside:
        lora.base_directory(adapter_dirs[0], "/etc", root)
    with pytest.raises(ModelLoadError, match="the adapter's base is not known") as unknown:
        lora.base_directory(adapter_dirs[0], None, root)
    assert outside.value.status == unknown.value.status == 400
    shipped = Path(shutil.copytree(adapter_dirs[0], tmp_path / "shipped"))
    lora_models.ship_base_inside(base, shipped)
    assert lora.base_directory(shipped, None, tmp_path) == shipped / "base"

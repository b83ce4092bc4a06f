"""LoRA adapters over one base, row by row: a pass that mixes adapters gives each row what PEFT's merged model gives it
alone, and an adapter this server cannot serve, or whose base is not there, fails its LOAD with the reason (400)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lora_models
import pytest
import torch

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.models import lora, lora_layers
from mme_runtime.models.loading import ModelSpec
from mme_runtime.models.package_cache import PackageCache


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
    unnamed = Path(shutil.copytree(adapter_dirs[0], tmp_path / "unnamed"))
    rewrite_config(unnamed, base_model_name_or_path=None)
    with pytest.raises(ModelLoadError, match="the adapter's base is not known") as unknown:
        lora.base_directory(unnamed, None, tmp_path)
    assert outside.value.status == unknown.value.status == 400
    shipped = Path(shutil.copytree(adapter_dirs[0], tmp_path / "shipped"))
    lora_models.ship_base_inside(base, shipped)
    assert lora.base_directory(shipped, None, tmp_path) == shipped / "base"


def fake_base(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    return directory


def fake_adapter(directory: Path, recorded: str | None) -> Path:
    """An adapter directory with only PEFT's config, naming its base as PEFT does."""
    directory.mkdir(parents=True)
    (directory / lora.CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": recorded}))
    return directory


def test_the_base_peft_recorded_is_a_path_or_a_name_beside_the_adapter_then_under_the_model_root(
    tmp_path: Path,
) -> None:
    root = tmp_path / "models"
    bert, beside, mirrored = fake_base(root / "bert"), fake_base(root / "team" / "bert"), fake_base(root / "org" / "m")
    assert lora.base_directory(fake_adapter(root / "absolute", str(bert)), None, root) == bert
    assert lora.base_directory(fake_adapter(root / "relative", "bert"), None, root) == bert
    assert lora.base_directory(fake_adapter(root / "team" / "a", "bert"), None, root) == beside
    assert lora.base_directory(fake_adapter(root / "team" / "b", "org/m"), None, root) == mirrored


def test_the_setting_wins_then_a_base_shipped_inside_then_the_recorded_one(tmp_path: Path) -> None:
    root = tmp_path / "models"
    recorded, other = fake_base(root / "recorded"), fake_base(root / "other")
    adapter = fake_adapter(root / "adapter", "recorded")
    inside = fake_base(adapter / "base")
    assert lora.base_directory(adapter, "../other", root) == other
    assert lora.base_directory(adapter, None, root) == inside
    fake_base(adapter / "second-base")  # two inside: neither is the one, the recorded name decides
    assert lora.base_directory(adapter, None, root) == recorded


def test_a_hub_id_that_names_nothing_here_fails_saying_where_it_looked_and_how_to_name_the_base(tmp_path: Path) -> None:
    root = tmp_path / "models"
    adapter = fake_adapter(root / "tenant" / "model", "meta-llama/Llama-3-8B")
    with pytest.raises(ModelLoadError) as unknown:
        lora.base_directory(adapter, None, root)
    message = unknown.value.message
    assert unknown.value.status == 400
    assert "base_model_name_or_path in its adapter_config.json is 'meta-llama/Llama-3-8B'" in message
    assert f"{root}/tenant/meta-llama/Llama-3-8B is not there, {root}/meta-llama/Llama-3-8B is not there" in message
    assert "nothing is downloaded from the Hugging Face Hub" in message
    assert "Set base_model=<directory or s3://...tar.gz> in the adapter's serving.properties" in message
    assert "ship the base as one directory inside the adapter's" in message


def test_a_recorded_base_outside_the_model_root_is_refused_unless_any_location_is(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "models", fake_base(tmp_path / "elsewhere")
    adapter = fake_adapter(root / "adapter", str(elsewhere))
    with pytest.raises(ModelLoadError, match=f"{elsewhere} is outside the model root"):
        lora.find_base(adapter, None, Config(model_root=root))
    assert lora.find_base(adapter, None, Config(model_root=root, allow_any_model_location=True)) == elsewhere


def test_an_adapter_naming_its_base_takes_the_package_of_the_adapters_that_set_it(tmp_path: Path) -> None:
    root = tmp_path / "models"
    (fake_base(root / "mlp") / "model.pth").write_bytes(b"\0" * 64)
    fake_adapter(root / "named", "mlp")
    (fake_adapter(root / "set", None) / "serving.properties").write_text("base_model=../mlp\n")
    cache = PackageCache(Config(model_root=root), lambda package: None)
    keys = [cache.key(ModelSpec(name, str(root / name), "handler_service", "/tmp")) for name in ("named", "set")]
    assert keys[0] is not None and keys[0] == keys[1]


def test_a_layer_holds_each_adapter_s_matrices_once_and_lets_one_go_leaving_the_others_in_place() -> None:
    torch.manual_seed(0)
    parts = {
        index: (torch.randn(rank, 6), torch.randn(5, rank), 0.5 * index) for index, rank in ((0, 2), (1, 4), (2, 3))
    }
    columns = None
    for index, part in parts.items():
        columns = lora_layers.Columns.adding(columns, index, *part)
    assert columns is not None
    assert columns.down.nbytes + columns.up.nbytes == sum(down.nbytes + up.nbytes for down, up, _ in parts.values())
    kept = columns.without(1)
    assert kept is not None and kept.ranges == {0: (0, 2), 2: (2, 5)}
    assert torch.equal(kept.down, torch.cat([parts[0][0], parts[2][0]]))
    assert torch.equal(kept.up, torch.cat([parts[0][1], parts[2][1]], dim=1))
    assert kept.owner.tolist() == [0, 0, 2, 2, 2] and kept.scaling == {0: 0.0, 2: 1.0}
    assert kept.without(0) is not None and kept.without(0).without(2) is None  # type: ignore[union-attr]


def test_an_adapter_s_load_writes_its_columns_in_the_room_kept_and_leaves_earlier_snapshots_as_they_were() -> None:
    torch.manual_seed(1)
    first = lora_layers.Columns.adding(None, 0, torch.randn(10, 6), torch.randn(5, 10), 1.0)  # room for 1 more
    second = lora_layers.Columns.adding(first, 1, torch.randn(1, 6), torch.randn(5, 1), 2.0)
    assert second.buffers[0].data_ptr() == first.buffers[0].data_ptr()  # no copy of the first adapter's
    assert first.used == 10 and first.owner.tolist() == [0] * 10 and second.owner.tolist() == [0] * 10 + [1]
    third = lora_layers.Columns.adding(second, 2, torch.randn(8, 6), torch.randn(5, 8), 3.0)  # no room left: packed
    assert third.buffers[0].data_ptr() != first.buffers[0].data_ptr() and third.ranges[2] == (11, 19)
    assert torch.equal(third.down[:11], second.down) and torch.equal(third.up[:, :11], second.up)
    fewer = third.without(1)  # 1 column of 19 dead: marked, not copied
    assert fewer is not None and fewer.buffers[0].data_ptr() == third.buffers[0].data_ptr()
    assert fewer.owner.tolist() == [0] * 10 + [lora_layers.DEAD] + [2] * 8 and 1 not in fewer.ranges

"""Which models share their device host: the container's switches, a model's own setting, its requirements."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.models.loading import (
    ResolvedModel,
    container_reason,
    model_reason,
    resolve_model,
    unmet_requirements,
)

NUMPY = metadata.version("numpy")
TORCH = metadata.version("torch")


def test_requirements_the_image_already_satisfies_are_met() -> None:
    text = f"""
    # pinned to what the image ships
    numpy=={NUMPY}
    torch>=2.0  # a comment after the requirement
    requests ; python_version < "3.0"
    """
    assert unmet_requirements(text) == []


@pytest.mark.parametrize(
    "line",
    [
        "surely-not-installed-package==1.0",
        f"numpy!={NUMPY}",
        "torch<1.0",
        "--index-url https://example.invalid/simple",
        "git+https://example.invalid/repo.git",
        "boto3[crt]",
    ],
)
def test_anything_the_image_cannot_vouch_for_is_unmet(line: str) -> None:
    assert unmet_requirements(f"numpy=={NUMPY}\n{line}\n") == [line]


def test_the_container_can_turn_sharing_off() -> None:
    handler = "handler_service:handle"
    assert container_reason(handler, Config()) is None
    assert container_reason(handler, Config(share_device=False)) == "MME_SHARE_DEVICE=false"
    assert container_reason("handler_service", Config()) is None
    assert "not this container's" in str(container_reason("/opt/other_handler.py:handle", Config()))


def _model(tmp_path: Path, properties: str | None = None, requirements: str | None = None) -> Path:
    model_dir = tmp_path / "model"
    (model_dir / "code").mkdir(parents=True)
    if properties is not None:
        (model_dir / "serving.properties").write_text(properties)
    if requirements is not None:
        (model_dir / "code" / "requirements.txt").write_text(requirements)
    return model_dir


def test_a_model_shares_unless_it_asks_for_a_process_or_brings_requirements(tmp_path: Path) -> None:
    config = Config(cache_dir=tmp_path / "cache")
    assert _reason(_model(tmp_path / "plain"), config) is None
    assert _reason(_model(tmp_path / "pinned", requirements=f"torch=={TORCH}\n"), config) is None
    own = _reason(_model(tmp_path / "own", properties="isolation=process\n"), config)
    assert own == "serving.properties sets isolation=process"
    extra = _reason(_model(tmp_path / "extra", requirements="surely-not-installed-package\n"), config)
    assert extra is not None and "surely-not-installed-package" in extra


def test_helper_modules_in_a_models_own_code_isolate_it_unless_it_says_their_names_are_unique(tmp_path: Path) -> None:
    """A host imports a script's helpers by their plain names: two models' ``utils`` cannot both be ``utils``."""
    config = Config(cache_dir=tmp_path / "cache")
    helped = _model(tmp_path / "helped")
    (helped / "code" / "inference.py").write_text("from utils import scale\n")
    (helped / "code" / "utils.py").write_text("scale = 2\n")
    (helped / "code" / "layers").mkdir()
    (helped / "code" / "layers" / "__init__.py").write_text("")
    reason = _reason(helped, config)
    assert reason is not None and "holds modules beside inference.py (layers/, utils.py)" in reason
    (helped / "serving.properties").write_text("isolation=shared\n")
    assert _reason(helped, config) is None
    # Code shared by every model (SAGEMAKER_SUBMIT_DIRECTORY) is the same files for all: it shares.
    common = tmp_path / "common"
    common.mkdir()
    (common / "inference.py").write_text("from utils import scale\n")
    (common / "utils.py").write_text("scale = 2\n")
    plain = tmp_path / "plain_model"
    plain.mkdir()
    assert _reason(plain, Config(cache_dir=tmp_path / "cache", submit_directory=str(common))) is None


def test_a_malformed_setting_fails_the_resolution_naming_the_file(tmp_path: Path) -> None:
    config = Config(cache_dir=tmp_path / "cache")
    with pytest.raises(ModelLoadError, match="reading serving settings failed: serving.properties is malformed"):
        resolve_model(_model(tmp_path / "bad", properties="isolation=maybe\n"), config)


def test_the_resolution_travels_as_json_and_comes_back_equal(tmp_path: Path) -> None:
    """The loader sends what it resolved to the hosts in a warm-process message: JSON."""
    model_dir = _model(tmp_path / "sent", properties="batch_size=4\nisolation=shared\n")
    resolved = resolve_model(model_dir, Config(cache_dir=tmp_path / "cache"))
    assert resolved.code_dir == model_dir / "code" and resolved.settings.batch_size == 4
    assert ResolvedModel.from_message(json.loads(json.dumps(resolved.message()))) == resolved


def _reason(model_dir: Path, config: Config) -> str | None:
    return model_reason(model_dir, resolve_model(model_dir, config), config)

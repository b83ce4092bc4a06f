"""PEFT LoRA adapters served with no code: a directory with ``adapter_config.json`` and
``adapter_model.safetensors`` is a model of its own over a base model, which is loaded once
(``model_fn`` loads the base; equal bases are one package, ``package_cache.py``, and their tensors
one copy, ``tensor_store.py``).

``read_adapter`` reads and checks an adapter and ``base_directory`` finds its base;
``lora_layers.py`` serves it over the base, row by row, so that the rows of many adapters share
their passes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.models.code_fetcher import CodeFetcher

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
# What makes a directory a base: a Hugging Face model's config, or a PyTorch model's file.
BASE_FILES = ("config.json", "model.pt", "model.pth")
# Where PEFT records the base an adapter was trained over: a hub id, or the path it was loaded from.
RECORDED_BASE = "base_model_name_or_path"
# PEFT's task types and the Hugging Face tasks they are served as.
TASK_TYPES = {
    "SEQ_CLS": "text-classification",
    "TOKEN_CLS": "token-classification",
    "FEATURE_EXTRACTION": "feature-extraction",
    "CAUSAL_LM": "text-generation",
    "SEQ_2_SEQ_LM": "text2text-generation",
}
# Options whose effect this server does not reproduce: an adapter that sets one fails its LOAD
# rather than answer wrong.
UNSUPPORTED = (
    "use_dora",
    "layers_to_transform",
    "layer_replication",
    "lora_bias",
    "target_parameters",
    "use_qalora",
)


def is_adapter_directory(model_dir: Path) -> bool:
    return (model_dir / CONFIG_FILE).is_file()


@dataclass
class Adapter:
    """One adapter's tensors: ``lora`` maps a module path to its (A, B, scaling); ``saved`` maps a
    module path to the state of the whole module the adapter replaces (PEFT's ``modules_to_save``, a
    classification head)."""

    task: str | None
    lora: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    saved: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tensors = [t for a, b, _ in self.lora.values() for t in (a, b)]
        tensors += [t for state in self.saved.values() for t in state.values()]
        return sum(tensor.nbytes for tensor in tensors)

    def let_go(self) -> int:
        """Forgets its tensors, which the layers it wraps hold now (``lora_layers.py``), so that
        they are in memory once; returns their bytes."""
        size = self.nbytes
        self.lora.clear()
        self.saved.clear()
        return size


def read_adapter(model_dir: Path) -> Adapter:
    """The adapter in ``model_dir``; ``ModelLoadError`` naming the problem when it is not one this
    server serves."""
    from safetensors.torch import load_file

    try:
        config = json.loads((model_dir / CONFIG_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(model_dir / WEIGHT_FILE))
    except FileNotFoundError as exc:
        raise ModelLoadError(
            f"an adapter needs {CONFIG_FILE} and {WEIGHT_FILE}: {exc.filename} is missing"
        ) from exc
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"the adapter in {model_dir.name} cannot be read: {exc}") from exc
    if config.get("peft_type") != "LORA":
        raise ModelLoadError(
            f"peft_type {config.get('peft_type')!r} is not served: only LORA adapters are",
            status=400,
        )
    for option in UNSUPPORTED:
        if config.get(option):
            raise ModelLoadError(
                f"adapter option {option}={config[option]!r} is not served", status=400
            )
    if config.get("bias", "none") != "none":
        raise ModelLoadError(
            f"adapter option bias={config['bias']!r} is not served (only 'none')", status=400
        )
    embeddings = sorted(
        {key.split(".lora_embedding_")[0] for key in tensors if ".lora_embedding_" in key}
    )
    if embeddings:
        raise ModelLoadError(
            f"the adapter targets {embeddings[0].removeprefix(PREFIX)}, an embedding: LoRA is "
            "served on Linear layers only",
            status=400,
        )
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    lora: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        path = key.removeprefix(PREFIX)
        if ".lora_A." in path:
            module = path.split(".lora_A.")[0]
            up = tensors.get(f"{PREFIX}{module}.lora_B.weight")
            if up is None:
                raise ModelLoadError(f"the adapter has lora_A for {module} but no lora_B")
            r, a = _pattern(ranks, module, rank), _pattern(alphas, module, alpha)
            scaling = a / r**0.5 if config.get("use_rslora") else a / r
            # (A: rank x in, B: out x rank); fan_in_fan_out is Conv1D's: refused
            lora[module] = (tensor, up, scaling)
        elif ".lora_B." not in path:
            module, _, parameter = path.rpartition(".")
            saved.setdefault(module, {})[parameter] = tensor
    if not lora:
        raise ModelLoadError(
            f"{WEIGHT_FILE} holds no LoRA matrices (keys like {PREFIX}<module>.lora_A.weight)"
        )
    return Adapter(TASK_TYPES.get(config.get("task_type") or ""), lora, saved)


def _pattern(pattern: dict[str, Any], module: str, default: float) -> float:
    """PEFT's ``rank_pattern``/``alpha_pattern``: the first key that the module's path ends with."""
    for key, value in pattern.items():
        if re.search(rf"(^|\.){re.escape(key)}$", module):
            return float(value)
    return default


def find_base(model_dir: Path, base_model: str | None, config: Config) -> Path:
    """The adapter's base directory (``base_directory``), or for
    ``base_model=s3://bucket/key.tar.gz`` the archive fetched once per ETag into
    ``MME_CACHE_DIR/bases`` (``code_fetcher.py``): its top, or its one directory that holds a
    model."""
    if base_model is not None and base_model.startswith("s3://"):
        fetched = CodeFetcher(config.cache_dir / "bases", config.s3_timeout_seconds).fetch(
            base_model
        )
        return (
            fetched if _holds_model(fetched) else _one_inside(fetched, f"the archive {base_model}")
        )
    anywhere = config.allow_any_model_location or not config.multi_model
    return base_directory(model_dir, base_model, config.model_root, anywhere)


def base_directory(
    model_dir: Path, base_model: str | None, model_root: Path, anywhere: bool = False
) -> Path:
    """The adapter's local base, the first that is given of (docs/sharing.md#lora-adapters):
    ``base_model=`` in its ``serving.properties`` (relative to the adapter, or absolute); the one
    directory inside the adapter's that holds a model (a Hugging Face ``config.json``, or a PyTorch
    ``model.pt``/``model.pth`` with the ``code/`` that builds it); the base PEFT recorded in its
    ``adapter_config.json``, where that names a model here. Under ``model_root`` unless
    ``anywhere``. A JSON read and a few stats, never S3: the warm process keys packages with it."""
    root = model_root.resolve()
    if base_model is not None:
        candidate = Path(base_model) if Path(base_model).is_absolute() else (model_dir / base_model)
        base = candidate.resolve()
        allowed = anywhere or base.is_relative_to(root)
        if not (allowed or base.is_relative_to(model_dir.resolve())):
            raise ModelLoadError(
                f"base_model={base_model} is outside the model root {model_root}", status=400
            )
        if not _holds_model(base):
            message = (
                f"base_model={base_model}: no model there (no config.json, model.pt or model.pth "
                f"in {base})"
            )
            raise ModelLoadError(message, status=400)
        return base
    inside = _models_inside(model_dir)
    if len(inside) == 1:
        return inside[0]
    name = _recorded_base(model_dir)
    tried: list[str] = []
    for candidate in _named_candidates(model_dir, name, root):
        if not (anywhere or candidate.is_relative_to(root)):
            tried.append(f"{candidate} is outside the model root")
        elif _holds_model(candidate):
            return candidate
        else:
            why = "holds no model" if candidate.is_dir() else "is not there"
            tried.append(f"{candidate} {why}")
    raise ModelLoadError(_unknown_base(name, tried, inside), status=400)


def _unknown_base(name: str | None, tried: list[str], inside: list[Path]) -> str:
    """What was looked for, and the two ways to name the base."""
    if name:
        recorded = (
            f"{RECORDED_BASE} in its {CONFIG_FILE} is {name!r}, which names no model here "
            f"({', '.join([*tried, 'and nothing is downloaded from the Hugging Face Hub'])})"
        )
    else:
        recorded = f"its {CONFIG_FILE} names none ({RECORDED_BASE})"
    shipped = "no directory inside the adapter's holds a model"
    if inside:
        shipped = f"several inside the adapter's do ({', '.join(path.name for path in inside)})"
    return (
        f"the adapter's base is not known: {recorded}; {shipped}. Set base_model=<directory or "
        "s3://...tar.gz> in the adapter's serving.properties, or ship the base as one directory "
        "inside the adapter's (the same archive)"
    )


def _recorded_base(model_dir: Path) -> str | None:
    """The base PEFT wrote when it saved the adapter: a hub id, or the path it was loaded from."""
    try:
        config = json.loads((model_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"the adapter in {model_dir.name} cannot be read: {exc}") from exc
    name = config.get(RECORDED_BASE) if isinstance(config, dict) else None
    return (name.strip() or None) if isinstance(name, str) else None


def _named_candidates(model_dir: Path, name: str | None, root: Path) -> list[Path]:
    """Where a recorded base may be: an absolute path as it is; a relative name (``base``, a hub id
    such as ``org/model``) beside the adapter, then under the model root."""
    if not name or "\0" in name:
        return []
    if Path(name).is_absolute():
        return [Path(name).resolve()]
    nearest = [model_dir.resolve().parent / name, root / name]
    return list(dict.fromkeys(path.resolve() for path in nearest))


def _models_inside(directory: Path) -> list[Path]:
    return sorted(path for path in directory.iterdir() if path.is_dir() and _holds_model(path))


def _one_inside(directory: Path, where: str) -> Path:
    inside = _models_inside(directory)
    if len(inside) != 1:
        found = "none" if not inside else ", ".join(path.name for path in inside)
        raise ModelLoadError(
            "the adapter's base is not known: set base_model=<directory or s3://...tar.gz> in its "
            f"serving.properties, or ship the base as one directory inside {where} (found: "
            f"{found})",
            status=400,
        )
    return inside[0]


def _holds_model(directory: Path) -> bool:
    return any((directory / name).is_file() for name in BASE_FILES)

"""Packages of shared models that the defaults load (a TorchScript ``model.pt``/``model.pth``, no inference code, or
the base of a LoRA adapter), kept by their artifacts: another name for the same files takes the same shared-memory
file, with no loader run, and a host unpacks it once (one copy of the weights; for adapters, one base their requests
share passes over). A package goes when its last model is unloaded.

The warm process's side of the model cache for models that share a device host (``model_cache.py`` is the isolated
servers'); ``MME_MODEL_CACHE_MB=0`` turns both off.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.models import hf_loading, lora
from mme_runtime.models.loading import ModelSpec
from mme_runtime.models.model_cache import MODEL_FILES, Key, key_for, model_file
from mme_runtime.models.model_package import Package
from mme_runtime.models.serving_properties import read_settings
from mme_runtime.operations import metrics

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    package: Package
    users: set[str] = field(default_factory=set)


class PackageCache:
    def __init__(self, config: Config, release: Callable[[Package], None]) -> None:
        self.config = config
        self.release_package = release  # the tensor store's: a package's tensors may be other packages' too
        self.entries: dict[Key, _Entry] = {}

    def key(self, spec: ModelSpec) -> Key | None:
        """The model's artifacts, when the defaults will load them and the cache is on; else None."""
        model_dir = Path(spec.model_dir)
        if self.config.model_cache_mb == 0 or self.config.submit_directory:
            return None
        if (model_dir / "code" / self.config.program).is_file():
            return None  # user code may bring its own model_fn: its result is not the files'
        try:
            if lora.is_adapter_directory(model_dir):
                return _base_key(model_dir, self.config)
            path = model_file(model_dir)
            return None if path is None else key_for(path)
        except (OSError, ValueError, ModelLoadError):
            return None  # its loader reports what is wrong

    def take(self, key: Key, name: str) -> Package | None:
        """The package already made from these artifacts, now used by ``name`` too; None (a miss) if there is none."""
        entry = self.entries.get(key)
        metrics.record_cache_lookup("model", hit=entry is not None)
        if entry is None:
            return None
        entry.users.add(name)
        logger.info("model cache hit %s: model=%s shares its package", key[0], name)
        return entry.package

    def add(self, key: Key, name: str, package: Package) -> Package:
        """The package ``name`` uses from now on: ``package``, or the one another name's loader made first (two
        loads of the same artifacts at once), in which case ``package`` is closed."""
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = _Entry(package, {name})
            return package
        entry.users.add(name)
        self.release_package(package)
        return entry.package

    def release(self, key: Key, name: str) -> None:
        """``name`` is unloaded; the package is closed once no model uses it."""
        entry = self.entries.get(key)
        if entry is None:
            return
        entry.users.discard(name)
        if not entry.users:
            del self.entries[key]
            self.release_package(entry.package)
            logger.info("model cache released %s", key[0])


def _base_key(adapter_dir: Path, config: Config) -> Key | None:
    """An adapter's base weights, with the adapter's task and the base's own script (a plain PyTorch base is what
    its ``model_fn`` makes of its files): adapters of one base for one task take one package."""
    settings = read_settings(adapter_dir, config)
    task = settings.task or json.loads((adapter_dir / lora.CONFIG_FILE).read_text()).get("task_type")
    if settings.base_model is not None and settings.base_model.startswith("s3://"):
        # Known by its URI, never asked of S3 here (the warm process's loop): a base fetched once stays the one its
        # adapters use while any is loaded; the loader fetches it anew, by ETag, after the last is gone.
        return (f"{settings.base_model}#{task}", 0, 0)
    base = lora.find_base(adapter_dir, settings.base_model, config)
    names = (*hf_loading.WEIGHT_FILES, *MODEL_FILES)
    weights = next((base / name for name in names if (base / name).is_file()), None)
    if weights is None:
        return None
    path, size, modified = key_for(weights)
    script = base / "code" / config.program
    code = key_for(script) if script.is_file() else None
    return (f"{path}#{task}#{code}", size, modified)

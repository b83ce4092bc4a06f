"""Packages of shared models, kept by their artifacts, so that no ``model_fn`` runs twice for the
same files.

Two uses of one mechanism:

* **Another name for the same artifacts** (a TorchScript ``model.pt``/``model.pth`` the defaults
  load, or the base of a LoRA adapter) takes the same shared-memory file, with no loader run, and a
  host unpacks it once: one copy of the weights; for adapters, one base their requests share passes
  over. Such a key is the artifacts' alone.
* **A re-LOAD after an UNLOAD** (SageMaker unloads under memory pressure and loads again on the next
  request): the package of the last model that used it is kept, least recently used first out,
  within ``MME_KEEP_UNLOADED_MB``, and never while a LOAD needs the host memory it holds
  (``make_room``). A model with inference code (or any model no other key fits) is kept under its
  name and its directory's files (path, size, modification time of each): the same name over the
  same files skips its loader, ``model_fn``, the S3 code fetch and the packing. A file rewritten,
  added or removed is another key.

The warm process keeps it for every model, shared or in a host of its own (a package remembers
which: ``placement``); ``MME_MODEL_CACHE_MB=0`` turns sharing across names off,
``MME_KEEP_UNLOADED_MB=0`` keeping.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.base.parsing import MIB
from mme_runtime.models import lora
from mme_runtime.models.loading import ModelSpec
from mme_runtime.models.model_package import MODEL_FILES, Package, model_file
from mme_runtime.models.serving_properties import read_settings
from mme_runtime.operations import metrics
from mme_runtime.operations.memory import artifact_bytes, available_bytes

logger = logging.getLogger(__name__)

# The files that may hold a base's weights, looked for in this order before a PyTorch model's
# file: registered by the package that loads such bases (``mme_runtime.huggingface``).
_weight_files: list[str] = []


def register_weight_files(names: Iterable[str]) -> None:
    """Adds the files that hold a kind of base's weights (each once), for ``_base_key``."""
    for name in names:
        if name not in _weight_files:
            _weight_files.append(name)


# The task a model directory is served for where it takes the package of its LoRA adapters for that
# task (None: a package of its own); registered by the package that serves such bases.
BaseTask = Callable[[Path, str | None, str | None], str | None]
_base_task: list[BaseTask] = []


def register_base_task(reader: BaseTask) -> None:
    """``reader(model_dir, its task setting, HF_TASK)``: the task of a base whose adapters' package
    it shares (a generative base and its adapters decode in one batch), else None."""
    _base_task[:] = [reader]


# a path, its size and its modification time: what names one set of artifacts
Key = tuple[str, int, int]


def key_for(path: Path) -> Key:
    """Same path, size and modification time: the same artifacts (a rewritten file is a new key)."""
    resolved = path.resolve()
    stat = resolved.stat()
    return (str(resolved), stat.st_size, stat.st_mtime_ns)


@dataclass
class _Entry:
    package: Package
    users: set[str] = field(default_factory=set)
    # why its models need a device host of their own (their loader said), if they do
    private: str | None = None
    threads: int | None = None  # the intra-op threads its model_fn chose, for such a host

    @property
    def held_bytes(self) -> int:
        """The memory its own shared-memory file holds (pages other packages' tensors stood for were
        punched)."""
        return os.fstat(self.package.fd).st_blocks * 512


class PackageCache:
    def __init__(self, config: Config, release: Callable[[Package], None]) -> None:
        self.config = config
        # the tensor store's: a package's tensors may be other packages' too
        self.release_package = release
        self.entries: OrderedDict[Key, _Entry] = OrderedDict()  # least recently used first
        # The entries no loaded model uses, least recently unloaded first, with what each holds
        # (read once, as it became unused: a kept file changes no more), and their sum: an UNLOAD
        # costs the same with 2,000 kept as with 2 (a sum of every kept file's fstat per UNLOAD
        # made a mass UNLOAD quadratic in the warm process).
        self._kept: OrderedDict[Key, int] = OrderedDict()
        self._kept_total = 0

    @property
    def kept_bytes(self) -> int:
        """What the packages of no loaded model hold."""
        return self._kept_total

    def key(self, spec: ModelSpec) -> Key | None:
        """The model's artifacts when the defaults load them (any name may share them), else its
        name and files (for its own re-LOAD); None when neither use is on."""
        model_dir = Path(spec.model_dir)
        try:
            shared = self._shared_key(model_dir)
            if shared is not None:
                return shared
            return (
                None
                if self.config.keep_unloaded_mb == 0
                else _own_key(spec.name, model_dir, self.config)
            )
        except (OSError, ValueError, ModelLoadError):
            return None  # its loader reports what is wrong

    def take(self, key: Key, name: str) -> Package | None:
        """The package already made from these artifacts, now used by ``name`` too; None (a miss) if
        there is none."""
        entry = self.entries.get(key)
        metrics.record_cache_lookup("model", hit=entry is not None)
        if entry is None:
            return None
        how = "shares its package" if entry.users else "takes its package, kept since its UNLOAD"
        entry.users.add(name)
        self._in_use(key)
        self.entries.move_to_end(key)
        logger.info("model cache hit %s: model=%s %s", key[0], name, how)
        return entry.package

    def placement(self, key: Key) -> tuple[str | None, int | None]:
        """What the loader that made the package said of where its models run: why they need a host
        of their own (None: they share) and the threads their ``model_fn`` chose. The same files, so
        the same answer."""
        entry = self.entries[key]
        return entry.private, entry.threads

    def add(
        self,
        key: Key,
        name: str,
        package: Package,
        private: str | None = None,
        threads: int | None = None,
    ) -> Package:
        """The package ``name`` uses from now on: ``package``, or the one another name's loader made
        first (two loads of the same artifacts at once), in which case ``package`` is closed.
        ``private`` and ``threads``: what its loader said of where its models run
        (``placement``)."""
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = _Entry(package, {name}, private, threads)
            return package
        entry.users.add(name)
        self._in_use(key)
        self.entries.move_to_end(key)
        self.release_package(package)
        return entry.package

    def release(self, key: Key, name: str, keep: bool = True) -> None:
        """``name`` is unloaded; once no model uses the package it is kept, if it fits (and
        ``keep``), for a LOAD to come."""
        entry = self.entries.get(key)
        if entry is None or name not in entry.users:
            return
        entry.users.discard(name)
        if not entry.users and not keep:
            self._evict(key, "not to be kept")
        elif not entry.users:
            self.entries.move_to_end(key)
            self._kept[key] = entry.held_bytes
            self._kept_total += self._kept[key]
            self._evict_beyond(self.config.keep_unloaded_mb * MIB)
            if key in self.entries:
                logger.info(
                    "model cache keeps %s (%d MiB kept in all)", key[0], self.kept_bytes // MIB
                )

    def make_room(self, spec: ModelSpec, loading_bytes: int = 0) -> int:
        """Before ``spec``'s loader runs: kept packages go, least recently used first, until the
        host has the memory its LOAD will check for (its artifacts and the headroom, beside
        ``loading_bytes`` for the LOADs still running), or none is left. Returns its artifacts'
        size."""
        model_bytes = artifact_bytes(Path(spec.model_dir))
        needed = model_bytes + loading_bytes + self.config.memory_headroom_mb * MIB
        while available_bytes()[0] < needed and self._evict_oldest("a LOAD needs the memory"):
            pass
        return model_bytes

    def _shared_key(self, model_dir: Path) -> Key | None:
        if self.config.model_cache_mb == 0 or self.config.submit_directory:
            return None
        if (model_dir / "code" / self.config.program).is_file():
            return None  # user code may bring its own model_fn: its result is not the files'
        if lora.is_adapter_directory(model_dir):
            return _base_key(model_dir, self.config)
        path = model_file(model_dir)
        if path is not None:
            return key_for(path)
        settings = read_settings(model_dir, self.config)
        task = _base_task[0](model_dir, settings.task, self.config.hf_task) if _base_task else None
        if task is None:
            return None
        return _weights_key(model_dir, task, self.config, settings.trust_remote_code)

    def _evict_beyond(self, limit_bytes: int) -> None:
        while self.kept_bytes > limit_bytes and self._evict_oldest(
            f"more than {limit_bytes // MIB} MiB kept"
        ):
            pass

    def _evict_oldest(self, why: str) -> bool:
        """Closes the least recently used package no model uses; False when there is none."""
        key = next(iter(self._kept), None)
        if key is None:
            return False
        self._evict(key, why)
        return True

    def _in_use(self, key: Key) -> None:
        """A kept package is used again: kept no more."""
        self._kept_total -= self._kept.pop(key, 0)

    def _evict(self, key: Key, why: str) -> None:
        self._in_use(key)
        self.release_package(self.entries.pop(key).package)
        logger.info("model cache released %s: %s", key[0], why)


def _own_key(name: str, model_dir: Path, config: Config) -> Key:
    """The model's name and every file it loads from: its directory, and a local
    ``SAGEMAKER_SUBMIT_DIRECTORY`` (an S3 one by its URI, as the code fetcher's cache is keyed)."""
    roots = [model_dir.resolve()]
    if config.submit_directory and not config.submit_directory.startswith("s3://"):
        roots.append(Path(config.submit_directory).resolve())
    files = []
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                stat = path.stat()
                files.append(f"{path.relative_to(root)}:{stat.st_size}:{stat.st_mtime_ns}")
    digest = xxhash.xxh3_128_hexdigest(
        "\n".join([*map(str, roots), config.submit_directory or "", *files]).encode()
    )
    return (f"{name}@{model_dir}#{digest}", len(files), 0)


def _base_key(adapter_dir: Path, config: Config) -> Key | None:
    """An adapter's base weights, with the adapter's task and the base's own script (a plain PyTorch
    base is what its ``model_fn`` makes of its files): adapters of one base for one task take one
    package."""
    settings = read_settings(adapter_dir, config)
    task_type = json.loads((adapter_dir / lora.CONFIG_FILE).read_text()).get("task_type")
    task = settings.task or lora.TASK_TYPES.get(task_type or "", task_type)
    if settings.base_model is not None and settings.base_model.startswith("s3://"):
        # Known by its URI, never asked of S3 here (the warm process's loop): a base fetched once
        # stays the one its adapters use while any is loaded; the loader fetches it anew, by ETag,
        # after the last is gone.
        return (f"{settings.base_model}#{task}", 0, 0)
    base = lora.find_base(adapter_dir, settings.base_model, config)
    return _weights_key(base, task, config, settings.trust_remote_code)


def _weights_key(base: Path, task: str | None, config: Config, trusted: bool) -> Key | None:
    """A base's weights for ``task``, with its own script, its other files (its config, its
    tokenizer: rewritten, they are another key) and whether its own code may run
    (``trust_remote_code`` of the model that loads it): what an adapter's LOAD, and a generative
    base's own, load."""
    names = (*_weight_files, *MODEL_FILES)
    weights = next((base / name for name in names if (base / name).is_file()), None)
    if weights is None:
        return None
    path, size, modified = key_for(weights)
    script = base / "code" / config.program
    code = key_for(script) if script.is_file() else None
    others = sorted(
        f"{other.name}:{stat.st_size}:{stat.st_mtime_ns}"
        for other in base.iterdir()
        if other != weights and other.is_file() and (stat := other.stat())
    )
    files = xxhash.xxh3_64_hexdigest("\n".join(others).encode())
    return (f"{path}#{task}#{code}#{files}#{trusted}", size, modified)

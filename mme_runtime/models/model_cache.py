"""Which file of a model directory is its TorchScript (``model.pt``, ``model.pth``), and the key that says two
LOADs name the same file: what the package cache (``package_cache.py``) and the defaults share."""

from __future__ import annotations

from pathlib import Path

MODEL_FILES = ("model.pt", "model.pth")
Key = tuple[str, int, int]


def model_file(model_dir: Path) -> Path | None:
    return next((model_dir / name for name in MODEL_FILES if (model_dir / name).is_file()), None)


def key_for(path: Path) -> Key:
    """Same path, size and modification time: the same artifacts (a rewritten file is a new key)."""
    resolved = path.resolve()
    stat = resolved.stat()
    return (str(resolved), stat.st_size, stat.st_mtime_ns)

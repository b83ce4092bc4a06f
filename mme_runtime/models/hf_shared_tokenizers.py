"""One tokenizer object for the models of a process whose tokenizers are the same.

Fine-tunes of one base ship the base's tokenizer files, byte for byte, and each LOAD unpickles a tokenizer of its
own: about 8 MiB for BERT's 30,522 entries, more than the rest of what a fine-tune adds beyond its head. The loader
gives each tokenizer a content key (``content_key``: its class, the model's task, the options it was loaded with and
the bytes of every file it reads), and a device host keeps one tokenizer per key while any model uses it
(``one_per_content``): a later model with the same key takes that one, and its own is dropped. A tokenizer is only
read once loaded; the threads that tokenize use lent copies of it (``serving/hf_tokenizer_copies.py``).
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any

import xxhash

# What every tokenizer may read besides the files its class names in ``vocab_files_names``.
COMMON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)

_lock = threading.Lock()
_by_key: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def content_key(model_dir: Path, task: str, tokenizer: Any, options: dict[str, Any]) -> str | None:
    """The key of ``tokenizer``, loaded from ``model_dir`` for ``task`` with ``options``; None without one."""
    if tokenizer is None:
        return None
    names = set(COMMON_FILES) | {str(name) for name in (getattr(tokenizer, "vocab_files_names", None) or {}).values()}
    digest = xxhash.xxh3_128()
    digest.update(
        f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}\0{task}\0{sorted(options.items())}".encode()
    )
    for name in sorted(names):
        path = model_dir / name
        if path.is_file():
            digest.update(f"\0{name}\0{path.stat().st_size}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def one_per_content(model: Any) -> bool:
    """Gives a Hugging Face model the tokenizer another model here holds for the same key (True), or registers its
    own."""
    key = getattr(model, "tokenizer_key", None)
    tokenizer = getattr(model, "tokenizer", None)
    if key is None or tokenizer is None:
        return False
    with _lock:
        held = _by_key.get(key)
        if held is None:
            _by_key[key] = tokenizer
            return False
        model.tokenizer = held
        return True

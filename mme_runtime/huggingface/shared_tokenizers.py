"""One tokenizer object for the models of a process whose tokenizers are the same.

Fine-tunes of one base ship the base's tokenizer files byte for byte, and each model's package carried a pickle of
its tokenizer that the host unpickled for it alone: for BERT's 30,522 entries, 1.2 MB of pickle and more once
unpickled, more than the rest of what a fine-tune adds beyond its head. So a Hugging Face model travels with its
tokenizer pickled into a tensor of bytes (``packed``), without the directory it was loaded from: equal tokenizers
give equal tensors, which a package holds once like any equal tensor (``tensor_store.py``). A host unpickles each
content once (``unpacked``), keyed by its digest and the model's task (a pipeline may set what its task needs), and
every later model with the same key takes that object while any model uses it. A tokenizer is only read once
loaded; the threads that tokenize use lent copies of it (``tokenizer_copies.py``).
"""

from __future__ import annotations

import copy
import logging
import pickle
import threading
import weakref
from typing import Any

import torch
import xxhash

logger = logging.getLogger(__name__)

PROTOCOL = 5

_lock = threading.Lock()
_by_key: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def packed(tokenizer: Any) -> torch.Tensor:
    """The tokenizer's pickle as a tensor of bytes, the same for tokenizers loaded from equal files anywhere."""
    neutral = copy.copy(tokenizer)  # shallow: the original keeps its directory
    neutral.name_or_path = ""
    init_kwargs = getattr(tokenizer, "init_kwargs", None)
    if isinstance(init_kwargs, dict):
        neutral.init_kwargs = {key: value for key, value in init_kwargs.items() if key != "name_or_path"}
    return torch.frombuffer(bytearray(pickle.dumps(neutral, protocol=PROTOCOL)), dtype=torch.uint8)


def unpacked(data: torch.Tensor, task: str, name_or_path: str) -> Any:
    """The tokenizer in ``data`` (``packed``'s): the one this process holds for the same bytes and task, or a new
    one, named after ``name_or_path``, the directory of the model that brought it first."""
    view = memoryview(data.numpy().data)  # the package's pages, not a copy
    key = f"{task}:{xxhash.xxh3_128_hexdigest(view)}"
    with _lock:
        held = _by_key.get(key)
    if held is not None:
        logger.info("a tokenizer equal to one a model here holds (%d bytes pickled): taken, not unpickled", view.nbytes)
        return held
    tokenizer = pickle.loads(view)
    tokenizer.name_or_path = name_or_path
    with _lock:
        return _by_key.setdefault(key, tokenizer)

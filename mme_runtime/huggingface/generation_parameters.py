"""What a request may ask of ``generate``, checked before its rows join a batch: the same rules for text generation
(``generation.py``) and a speech recognizer's (``audio_tasks.py``).

Two kinds of parameter are the server's business, not the client's. How a generation is held (its cache, compiling
it, batching it) is the server's: a static cache of ``max_cache_len`` 10**6 is allocated whole, and an offloaded one
fails on a CPU. And a parameter that names token ids must name ids of the model's vocabulary: one past it fails the
embedding or a logits processor's index, on a GPU with a device-side assert that leaves the CUDA context of every
model of the device's process unusable.
"""

from __future__ import annotations

from typing import Any

from mme_runtime.base.errors import InvalidInput

SERVER_PARAMETERS = frozenset(
    {
        "use_cache",
        "cache_implementation",
        "cache_config",
        "max_cache_len",
        "compile_config",
        "disable_compile",
        "continuous_batching_config",
    }
)
# Generation parameters that hold token ids (decoder_start_token_id, suppress_tokens, bad_words_ids...).
TOKEN_ID_SUFFIXES = ("token_id", "token_ids", "suppress_tokens", "words_ids")


def check_token_ids(parameters: dict[str, Any], vocabulary: int | None) -> None:
    """Raises ``InvalidInput`` (400) for a token id outside the model's ``vocabulary`` (None: it says none)."""
    if vocabulary is None:
        return
    for key, value in parameters.items():
        if key.endswith(TOKEN_ID_SUFFIXES):
            outside = [token for token in _integers(value) if not 0 <= token < vocabulary]
            if outside:
                raise InvalidInput(f"{key} names token ids {outside[:5]} outside the model's {vocabulary} tokens")


def vocabulary(model: Any) -> int | None:
    """How many token ids the model embeds (its decoder's, for an encoder-decoder), or None when it says none."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return int(getattr(embeddings, "num_embeddings", 0)) or None


def _integers(value: Any) -> list[int]:
    """The integers in a parameter's value, however nested in lists."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [token for item in value for token in _integers(item)]
    return []

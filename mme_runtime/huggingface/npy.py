"""``application/x-npy`` requests and answers of a Hugging Face model served with no code.

A request's array is its ``inputs``, as the SageMaker SDK's ``NumpySerializer`` writes them: an array of strings is a
text (0-d) or the nested lists of its texts (``["a", "b"]``; ``[[query, passage], ...]`` for sentence-ranking), and an
array of numbers is audio samples, at the model's own rate (1-d: one input; 2-d: one input a row). A pickled object
array (what ``np.save`` writes for a dict or a list of mixed types) is refused: unpickling a request could run any code.
The AWS toolkit decodes such bodies into an array that its default handler cannot read; here they answer.

An answer in NPY is the answer's numbers (feature-extraction's vectors, the sentence tasks' embeddings, similarities
or scores), as ``np.save`` writes the JSON answer's numbers (float64); an answer of records or text has no NPY form.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface import audio

TEXT_KINDS = "US"  # unicode, and bytes read as UTF-8
NUMBER_KINDS = "biuf"
NO_FORM = "this answer has no NPY form (it is not numbers in a rectangular array): ask for application/json"


def inputs(body: bytes | bytearray | str) -> Any:
    """The ``inputs`` an NPY body holds. Raises ``InvalidInput`` naming what is wrong with it."""
    if isinstance(body, str):
        raise InvalidInput("an NPY body must be binary")
    stream = io.BytesIO(bytes(body))
    try:
        version = np.lib.format.read_magic(stream)
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        dtype = header(stream)[2]
    except (ValueError, OSError, EOFError) as exc:
        raise InvalidInput(f"the body is not an NPY array: {exc}") from exc
    if dtype.hasobject:
        raise InvalidInput(
            "an NPY body holding Python objects (a pickle) is refused: send an array of strings or numbers"
        )
    try:
        array = np.load(io.BytesIO(bytes(body)), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise InvalidInput(f"the body is not an NPY array: {exc}") from exc
    if array.dtype.kind in TEXT_KINDS:
        if array.dtype.kind == "S":
            try:
                array = np.char.decode(array, "utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidInput(f"an NPY array of bytes must hold UTF-8 text: {exc}") from exc
        return array.tolist()  # a str for a 0-d array, else (nested) lists of them
    if array.dtype.kind in NUMBER_KINDS:
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise InvalidInput("the NPY array holds NaN or infinity")
        if array.ndim == 2 and len(array) > audio.MAX_CLIPS:  # before six million rows become six million arrays
            raise InvalidInput(f"an NPY body holds one clip a row: {len(array)} rows, at most {audio.MAX_CLIPS}")
        return list(array) if array.ndim == 2 else array
    raise InvalidInput(f"an NPY body must hold strings or numbers, not {array.dtype}")


def encode(answer: Any) -> bytes:
    """The answer's numbers as NPY: a numeric answer as it is, and a dict of one numeric entry (``{"embeddings":
    ...}``) as that entry. Raises ``InvalidInput`` for an answer of records or text."""
    if isinstance(answer, dict) and len(answer) == 1:
        answer = next(iter(answer.values()))
    try:
        array = np.asarray(answer)
    except ValueError as exc:  # ragged: vectors of texts of different lengths
        raise InvalidInput(NO_FORM) from exc
    if array.dtype.kind not in NUMBER_KINDS:
        raise InvalidInput(NO_FORM)
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()

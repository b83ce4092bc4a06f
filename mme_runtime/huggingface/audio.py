"""Speech recognition and audio classification over a batch of requests: each clip (decoded by
``requests.py``) is resampled to the model's rate and prepared alone by the task's pipeline,
with its request's own parameters; rows that can share a forward pass are stacked into one, and
each row's outputs, cut back to its own, are post-processed as the pipeline does for that clip
alone.

Which rows share a pass: rows of one shape always (Whisper's features are 30 s windows, whatever
the clip), with the same generation parameters for a recognizer that generates; rows of different
lengths only for a model that masks padding as if it were not there (``feat_extract_norm="layer"``:
Wav2Vec2 large, HuBERT, WavLM...): its convolutions normalize each frame alone and its attention
masks the padded frames. A model whose first convolution normalizes over the whole clip
(``"group"``, Wav2Vec2 base) would see the padding: its clips of different lengths run alone.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import torch

from mme_runtime.base.errors import InvalidInput
from mme_runtime.huggingface.generation import SERVER_PARAMETERS
from mme_runtime.huggingface.loading import HuggingFaceModel
from mme_runtime.huggingface.prompts import check_token_ids, vocabulary
from mme_runtime.huggingface.requests import Audio, TaskRequest, resample
from mme_runtime.huggingface.tasks import length_groups, lent_pipeline, pad, postprocess, prepare

REFUSED_PARAMETERS = frozenset(
    {"return_tensors", "timeout", "decoder_kwargs", "prompt_ids", "assistant_model"}
)
# A generating recognizer's parameters beyond GenerationConfig's own names, as Whisper's generate
# takes them.
SPEECH_GENERATION_PARAMETERS = frozenset(
    {"language", "task", "return_timestamps", "return_language"}
)
MAX_BEAMS = 8  # each beam is a row of the generation: a request may not multiply its rows past this
# A clip's main input, by model kind: raw samples (Wav2Vec2) or a spectrogram (Whisper).
INPUT_KEYS = ("input_values", "input_features")


class AudioRunner:
    """One placed speech model's task, with a copy of its tokenizer lent for each batch, as
    ``tasks.TaskRunner`` lends them."""

    def __init__(self, model: HuggingFaceModel, device: torch.device) -> None:
        transformers: Any = importlib.import_module("transformers")
        self.model = model
        self.task = model.task
        self._pipeline = transformers.pipeline(
            self.task,
            model=model.model,
            tokenizer=model.tokenizer,
            feature_extractor=model.feature_extractor,
            device=device,
        )
        self._sampling_rate = int(model.feature_extractor.sampling_rate)
        self._masks_padding = masks_padding(model.model)
        self._generates = getattr(self._pipeline, "type", "") in {"seq2seq", "seq2seq_whisper"}
        # A CTC model's logits (and tokens) are one per frame, cut back to a row's own; a
        # classifier's one per label.
        self._per_frame = self.task == "automatic-speech-recognition" and not self._generates
        self._vocabulary = vocabulary(model.model) if self._generates else None
        generation_config: Any = getattr(model.model, "generation_config", None)
        self._end_tokens = getattr(generation_config, "eos_token_id", None)

    def run(self, requests: list[TaskRequest]) -> list[Any]:
        """Each clip's answer, in order (one per input of every request), with a tokenizer lent for
        the batch."""
        with lent_pipeline(self._pipeline) as pipeline:
            return self._run(pipeline, requests)

    def _run(self, pipeline: Any, requests: list[TaskRequest]) -> list[Any]:
        # (first row, rows, postprocess parameters) per clip
        plans: list[tuple[int, int, dict[str, Any]]] = []
        rows: list[dict[str, Any]] = []
        forwards: list[dict[str, Any]] = []  # each row's forward (generation) parameters
        for request in requests:
            before, forward, after = self._parameters(pipeline, request)
            for item in request.inputs:
                if not isinstance(item, Audio):
                    raise InvalidInput(
                        f"{self.task} takes audio (audio/x-flac, audio/wave, ... or base64 in JSON)"
                    )
                prepared = prepare(pipeline, resample(item, self._sampling_rate), before, "audio")
                for row in prepared:
                    self._check_frames(row)
                plans.append((len(rows), len(prepared), after))
                rows += prepared
                forwards += [forward] * len(prepared)
        outputs = self._forward(pipeline, rows, forwards)
        # a ChunkPipeline: postprocess takes a clip's rows
        chunked = self.task == "automatic-speech-recognition"
        return [
            postprocess(
                pipeline, outputs[first : first + count] if chunked else outputs[first], after
            )
            for first, count, after in plans
        ]

    def _forward(
        self, pipeline: Any, rows: list[dict[str, Any]], forwards: list[dict[str, Any]]
    ) -> list[Any]:
        """The model over ``rows``, in the passes ``pass_groups`` plans, handed back row by row."""
        outputs: list[Any] = [None] * len(rows)
        for group in pass_groups(rows, forwards, self._masks_padding):
            members = [rows[index] for index in group]
            batch = members[0] if len(members) == 1 else pad_rows(members)
            try:
                result = pipeline.forward(batch, **forwards[group[0]])
            except (ValueError, TypeError) as exc:
                if not forwards[group[0]]:
                    raise  # no parameters of the client's: the server's fault, a 500
                # generate refuses the parameters (a max_new_tokens past the model's positions): the
                # client's
                raise InvalidInput(f"the model could not run with these parameters: {exc}") from exc
            for position, index in enumerate(group):
                outputs[index] = (
                    result if len(members) == 1 else self._row(result, position, rows[index])
                )
        return outputs

    def _row(self, batch: Any, index: int, prepared: dict[str, Any]) -> Any:
        """Row ``index`` of a pass's outputs as the clip's pass alone gives them: a CTC model's
        frames cut back to the clip's own, a generation's tokens to its first end token (the batch
        pads rows that ended sooner)."""
        frames = self._frames(prepared)
        values = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                value = value[index : index + 1]
                if key in ("tokens", "logits") and frames is not None and self._per_frame:
                    value = value[:, :frames]
                elif key == "tokens" and self._generates:
                    value = _cut_after_end(value, self._end_tokens)
            elif isinstance(value, list):
                value = value[index]
            values[key] = value
        # a classifier's ModelOutput stays one
        return values if type(batch) is dict else type(batch)(values)

    def _frames(self, prepared: dict[str, Any]) -> int | None:
        """How many frames the model makes of the row's samples (its outputs past these are
        padding)."""
        lengths = getattr(self.model.model, "_get_feat_extract_output_lengths", None)
        samples = prepared.get("input_values")
        if lengths is None or not isinstance(samples, torch.Tensor):
            return None
        return int(lengths(torch.tensor(samples.shape[-1])))

    def _check_frames(self, row: dict[str, Any]) -> None:
        """A clip (or chunk) too short for the model's convolutions to make one frame (Wav2Vec2
        needs 400 samples, 25 ms) would fail its pass with a RuntimeError, a 500 for every request
        of the batch: it is this one's 400."""
        frames = self._frames(row)
        if frames is not None and frames < 1:
            samples = row["input_values"].shape[-1]
            raise InvalidInput(
                f"the audio (or a chunk of it) is too short for the model: {samples} samples at "
                f"{self._sampling_rate} Hz make no frame of its output"
            )

    def _parameters(
        self, pipeline: Any, request: TaskRequest
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        refused = (REFUSED_PARAMETERS | SERVER_PARAMETERS) & set(request.parameters)
        if refused:
            raise InvalidInput(f"parameters {sorted(refused)} are not accepted here")
        try:
            before, forward, after = pipeline._sanitize_parameters(**request.parameters)
        except Exception as exc:  # noqa: BLE001
            # whatever the pipeline refuses in them is the request's
            raise InvalidInput(f"parameters {request.parameters}: {exc}") from exc
        if self.task == "automatic-speech-recognition":
            _check_generation(forward, self._generates, self._vocabulary)
        return (
            {**pipeline._preprocess_params, **before},
            {**pipeline._forward_params, **forward},
            {**pipeline._postprocess_params, **after},
        )


def masks_padding(model: Any) -> bool:
    """Whether padding a clip changes none of its outputs: each frame normalized alone, padded
    frames masked."""
    return getattr(model.config, "feat_extract_norm", None) == "layer" and hasattr(
        model, "_get_feat_extract_output_lengths"
    )


def pass_groups(
    rows: list[dict[str, Any]], forwards: list[dict[str, Any]], maskable: bool
) -> list[list[int]]:
    """Indices of ``rows`` in groups that share a pass: the same forward parameters, and the same
    shape unless the model masks padding; then grouped by length as text is
    (``tasks.length_groups``), in frames of 320 samples."""
    kinds: dict[str, list[int]] = {}
    for index, (row, forward) in enumerate(zip(rows, forwards, strict=True)):
        main = _main_input(row)
        shape = "any" if maskable else tuple(main.shape)
        # a chunk's "stride" too: the pass hands it on only where every row has one
        names = sorted(row)
        kinds.setdefault(
            json.dumps([forward, str(shape), names], sort_keys=True, default=str), []
        ).append(index)
    groups: list[list[int]] = []
    for members in kinds.values():
        if not maskable:
            groups.append(members)
            continue
        frames = [_main_input(rows[index]).shape[-1] // 320 for index in members]
        groups += [[members[position] for position in group] for group in length_groups(frames)]
    return groups


def pad_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One batch of ``rows``: samples padded on the right with zeros (the feature extractors'
    padding value) under an attention mask of zeros; a row prepared without a mask gets one of ones,
    which changes nothing of its own."""
    with_masks = []
    for row in rows:
        main = _main_input(row)
        if "attention_mask" not in row and main.dim() == 2:
            row = {**row, "attention_mask": torch.ones(main.shape, dtype=torch.long)}
        with_masks.append(row)
    return pad(with_masks, 0)


def _main_input(row: dict[str, Any]) -> torch.Tensor:
    for key in INPUT_KEYS:
        if isinstance(row.get(key), torch.Tensor):
            return row[key]  # type: ignore[no-any-return]
    raise InvalidInput(f"the feature extractor made none of {INPUT_KEYS} of this clip")


def _cut_after_end(tokens: torch.Tensor, end: int | list[int] | None) -> torch.Tensor:
    ends = [end] if isinstance(end, int) else list(end or [])
    hits = [position for position, token in enumerate(tokens[0].tolist()) if token in ends]
    return tokens[:, : hits[0] + 1] if hits else tokens


def _check_generation(
    forward: dict[str, Any], generates: bool, vocabulary_size: int | None = None
) -> None:
    """A CTC model generates nothing: only ``return_timestamps`` reaches its pass. A generating one
    takes what its ``generate`` takes, ``num_beams`` up to ``MAX_BEAMS``, one sequence per clip, and
    token ids of its vocabulary: one past it (``decoder_start_token_id``, ``pad_token_id``) fails
    the embedding, on a GPU with a device-side assert that leaves the CUDA context of every model of
    the device's process unusable."""
    if not generates:
        unknown = set(forward) - {"return_timestamps"}
        if unknown:
            raise InvalidInput(
                f"a CTC speech model takes no generation parameters: {sorted(unknown)}"
            )
        return
    transformers: Any = importlib.import_module("transformers")
    known = set(transformers.GenerationConfig().to_dict()) | SPEECH_GENERATION_PARAMETERS
    unknown = set(forward) - known
    if unknown:
        raise InvalidInput(
            f"parameters {sorted(unknown)} are not generation parameters of this model"
        )
    beams = forward.get("num_beams", 1)
    if not isinstance(beams, int) or isinstance(beams, bool) or not 1 <= beams <= MAX_BEAMS:
        raise InvalidInput(f"num_beams must be an integer from 1 to {MAX_BEAMS}, not {beams!r}")
    if forward.get("num_return_sequences", 1) != 1:
        raise InvalidInput(
            "a speech recognizer answers one text per clip: num_return_sequences must be 1"
        )
    check_token_ids(forward, vocabulary_size)

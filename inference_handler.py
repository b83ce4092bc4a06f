"""PyTorch defaults for the SageMaker inference contract, behaving like the AWS PyTorch handler
1.5.1.

Differences that matter: the model is loaded to host memory and placed on its device host's device
once (not per request), inference runs under ``torch.inference_mode``, and errors carry HTTP
statuses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from sagemaker_inference.default_inference_handler import DefaultInferenceHandler

from mme_runtime.base.errors import InvalidInput, ModelLoadError, first_line
from mme_runtime.models import model_package, pt2
from mme_runtime.serving import content

MODEL_FILES = model_package.MODEL_FILES


class DefaultPytorchInferenceHandler(DefaultInferenceHandler):  # type: ignore[misc]
    """Defaults used for any contract function the user's ``code/inference.py`` does not define."""

    def default_model_fn(self, model_dir: str, context: Any = None) -> Any:
        """Loads ``model.pt2`` (an exported program, or an AOTInductor package that each device host
        loads on its device), else ``model.pt``/``model.pth`` as TorchScript, to host memory; the
        host places it."""
        exported = pt2.pt2_file(Path(model_dir))
        if exported is not None:
            return pt2.load(exported)
        path = model_package.model_file(Path(model_dir))
        if path is None:
            raise ModelLoadError(
                f"no {' or '.join((pt2.PT2_FILE, *MODEL_FILES))} in {model_dir}: save a model "
                "there (torch.export, AOTInductor or TorchScript), or supply model_fn in "
                "code/inference.py"
            )
        try:
            return torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call,unused-ignore]
        except RuntimeError as jit_error:
            raise _not_torchscript(path, jit_error) from jit_error

    def default_input_fn(
        self, input_data: Any, content_type: str | None, context: Any = None
    ) -> torch.Tensor:
        """Decodes JSON, CSV or NPY into a tensor (float32 for the text formats, as the AWS handler
        does)."""
        return content.decode(input_data, content_type)

    def default_predict_fn(self, data: Any, model: Any, context: Any = None) -> Any:
        """Runs the model under inference mode on its device (the model is already there)."""
        device = getattr(context, "device", None) or torch.device("cpu")
        with torch.inference_mode():
            if isinstance(data, torch.Tensor):
                data = data.to(device, non_blocking=True)
            try:
                return model(data)
            except torch.cuda.OutOfMemoryError:
                raise  # 507, not the caller's fault
            except (RuntimeError, ValueError, IndexError, TypeError) as exc:
                # The defaults decoded this input themselves, so a model that refuses it was sent
                # the wrong shape or type: the caller's error, with the model's own words.
                shape = tuple(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__
                reason = first_line(exc)
                raise InvalidInput(
                    f"the model rejected an input of shape {shape}: {reason}"
                ) from exc

    def default_output_fn(self, prediction: Any, accept: str, context: Any = None) -> bytes:
        """Encodes the prediction as JSON, CSV or NPY; ``accept`` was negotiated from the request's
        header."""
        return content.encode(prediction, accept)


def _not_torchscript(path: Path, jit_error: RuntimeError) -> ModelLoadError:
    """Explains what ``path`` holds when it is not TorchScript, and what the user must supply."""
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception:
        # not a weights-only checkpoint either: report the TorchScript error, the likelier intent
        return ModelLoadError(
            f"{path.name} is not a TorchScript model ({str(jit_error).splitlines()[0]}); "
            "supply model_fn in code/inference.py to load it"
        )
    kind = (
        f"a state dict with {len(state)} entries"
        if isinstance(state, dict)
        else f"a {type(state).__name__}"
    )
    return ModelLoadError(
        f"{path.name} holds {kind}, not a TorchScript model: supply model_fn in code/inference.py "
        "that builds the model and loads these weights"
    )

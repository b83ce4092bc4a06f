"""Builds the tiny models the tests and `make serve` use, on the fly (nothing is downloaded).

Each builder writes a SageMaker model directory: the artifacts plus, where the style needs it, ``code/inference.py``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import NamedTuple

import torch

from mme_runtime.models.pt2 import input_metadata

IN_FEATURES = 4
OUT_FEATURES = 3


class TinyNet(torch.nn.Module):
    """Linear layer plus softmax: deterministic for a fixed seed and cheap enough for every test."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(IN_FEATURES, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc(x), dim=-1)


def tiny_net(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet().eval()


def write_code(model_dir: Path, source: str, name: str = "inference.py") -> Path:
    code = model_dir / "code"
    code.mkdir(parents=True, exist_ok=True)
    path = code / name
    path.write_text(textwrap.dedent(source).lstrip(), encoding="utf-8")
    return path


def torchscript_model(model_dir: Path, seed: int = 0) -> Path:
    """A TorchScript ``model.pt`` and no code: served entirely by the defaults."""
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.jit.script(tiny_net(seed)).save(str(model_dir / "model.pt"))
    return model_dir


# In the style of the AWS MNIST example: a state dict plus a script defining the network and all four functions.
STATE_DICT_SCRIPT = """
import json
import logging
import os

import torch

logger = logging.getLogger(__name__)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.softmax(self.fc(x), dim=-1)


def model_fn(model_dir):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = Net()
    with open(os.path.join(model_dir, "model.pth"), "rb") as f:
        model.load_state_dict(torch.load(f, map_location="cpu"))
    return model.to(device)


def input_fn(request_body, request_content_type):
    assert request_content_type == "application/json", request_content_type
    data = json.loads(request_body)["inputs"]
    return torch.tensor(data, dtype=torch.float32)


def predict_fn(input_object, model):
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(input_object.to(device))


def output_fn(predictions, content_type):
    assert content_type == "application/json"
    return json.dumps({"predictions": predictions.cpu().numpy().tolist()})
"""


def state_dict_model(model_dir: Path, seed: int = 0) -> Path:
    """A ``model.pth`` state dict with an AWS-style ``code/inference.py`` (written for the AWS container)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.save(tiny_net(seed).state_dict(), model_dir / "model.pth")
    write_code(model_dir, STATE_DICT_SCRIPT)
    return model_dir


TRANSFORM_SCRIPT = """
import json

import torch


def model_fn(model_dir):
    return torch.jit.load(model_dir + "/model.pt", map_location="cpu")


def transform_fn(model, request_body, content_type, accept):
    data = torch.tensor(json.loads(request_body), dtype=torch.float32)
    with torch.inference_mode():
        scores = model(data)
    return json.dumps({"argmax": scores.argmax(dim=-1).tolist()}), "application/vnd.argmax+json"
"""


def transform_model(model_dir: Path, seed: int = 0) -> Path:
    """TorchScript weights with a ``transform_fn`` that answers its own content type."""
    torchscript_model(model_dir, seed)
    write_code(model_dir, TRANSFORM_SCRIPT)
    return model_dir


CONTEXT_SCRIPT = """
import json
import os


def model_fn(model_dir, context):
    return {"model_dir": model_dir, "loaded_by_pid": os.getpid()}


def input_fn(request_body, content_type, context):
    return {"body": request_body, "content_type": content_type}


def predict_fn(data, model, context):
    return {
        "model_name": context.model_name,
        "model_dir": context.model_dir,
        "system_model_dir": context.system_properties["model_dir"],
        "gpu_id": context.gpu_id,
        "system_gpu_id": context.system_properties["gpu_id"],
        "batch_size": context.batch_size,
        "device": str(context.device),
        "custom_attributes": context.custom_attributes,
        "legacy_custom_attributes": context.get_request_header(
            context.request_index, "X-Amzn-SageMaker-Custom-Attributes"
        ),
        "request_id": context.request_id,
        "batch_items": len(context.request_ids),
        "content_type": data["content_type"],
        "pid": os.getpid(),
        "loaded_by_pid": model["loaded_by_pid"],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def output_fn(prediction, accept, context):
    return json.dumps(prediction), "application/json"
"""


def context_model(model_dir: Path) -> Path:
    """No weights: reports what ``context`` tells user code (device, gpu id, headers, pids)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    write_code(model_dir, CONTEXT_SCRIPT)
    return model_dir


FAILING_SCRIPT = """
def model_fn(model_dir):
    raise RuntimeError("weights are corrupt: checksum mismatch")
"""


def failing_model(model_dir: Path) -> Path:
    """A ``model_fn`` that raises: LOAD must fail naming the cause."""
    model_dir.mkdir(parents=True, exist_ok=True)
    write_code(model_dir, FAILING_SCRIPT)
    return model_dir


USER_ERROR_SCRIPT = """
import json

from mme_runtime.base.errors import ContainerError


class QuotaExceeded(ContainerError):
    status = 429


def model_fn(model_dir):
    return None


def transform_fn(model, request_body, content_type, accept):
    request = json.loads(request_body)
    if request.get("raise") == "quota":
        raise QuotaExceeded("tenant over quota")
    if request.get("raise") == "bug":
        raise KeyError("missing_feature")
    return json.dumps({"ok": True})
"""


def user_error_model(model_dir: Path) -> Path:
    """A ``transform_fn`` that raises a user-chosen 4xx or a plain bug (500)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    write_code(model_dir, USER_ERROR_SCRIPT)
    return model_dir


BUILDERS = {
    "torchscript": torchscript_model,
    "state_dict": state_dict_model,
    "transform": transform_model,
}


COUNTING_SCRIPT = """
import json
import os
import time

import torch


def model_fn(model_dir, context):
    # One line per call, whichever process makes it: the tests count model_fn calls across processes.
    with open(os.path.join(model_dir, "model_fn_calls.log"), "a") as log:
        log.write(f"{os.getpid()}\\n")
    if os.path.exists(os.path.join(model_dir, "fake_cuda_init")):
        # Test double of the CUDA probe: on a CPU-only machine this simulates a model_fn that moved the
        # model to "cuda" and so initialised CUDA in the loader.
        import mme_runtime.base.devices
        mme_runtime.base.devices.cuda_initialized = lambda: True
    return torch.jit.load(os.path.join(model_dir, "model.pt"), map_location="cpu")


def predict_fn(data, model, context):
    time.sleep(float(os.environ.get("MME_TEST_PREDICT_SLEEP", "0.05")))
    with torch.inference_mode():
        scores = model(data.to(context.device))
    return {
        "scores": scores.tolist(),
        "pid": os.getpid(),
        "device": str(context.device),
        "gpu_id": context.gpu_id,
        "system_gpu_id": context.system_properties["gpu_id"],
        "parameter_device": str(next(model.parameters()).device),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "threads": torch.get_num_threads(),
    }


def output_fn(prediction, accept, context):
    return json.dumps(prediction), "application/json"
"""


def counting_model(model_dir: Path, fake_cuda_init: bool = False) -> Path:
    """TorchScript weights whose model_fn logs each call (and can simulate initialising CUDA)."""
    torchscript_model(model_dir)
    write_code(model_dir, COUNTING_SCRIPT)
    if fake_cuda_init:
        (model_dir / "fake_cuda_init").touch()
    return model_dir


def model_fn_calls(model_dir: Path) -> list[int]:
    log = model_dir / "model_fn_calls.log"
    return [int(line) for line in log.read_text().split()] if log.exists() else []


# A state dict big enough that torch's CPU ops run in parallel (OpenMP) when model_fn loads it and warms it up.
WIDE_FEATURES = 1000
WIDE_SCRIPT = """
import os

import torch

WIDE = {features}


def model_fn(model_dir):
    with open(os.path.join(model_dir, "model_fn_calls.log"), "a") as log:
        log.write(f"{{os.getpid()}}\\n")
    {threads}
    model = torch.nn.Sequential(torch.nn.Linear(WIDE, WIDE), torch.nn.Softmax(dim=-1))
    model.load_state_dict(torch.load(os.path.join(model_dir, "model.pth"), map_location="cpu"))
    with torch.inference_mode():
        model(torch.ones(64, WIDE))  # a warm-up pass, as many scripts do
    return model.eval()
"""


def wide_model(model_dir: Path, threads: int | None = None) -> Path:
    """A 4 MB state dict whose ``model_fn`` runs parallel CPU ops (optionally after ``torch.set_num_threads``)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDE_FEATURES, WIDE_FEATURES), torch.nn.Softmax(dim=-1))
    torch.save(model.state_dict(), model_dir / "model.pth")
    choice = "pass" if threads is None else f"torch.set_num_threads({threads})"
    write_code(model_dir, WIDE_SCRIPT.format(features=WIDE_FEATURES, threads=choice))
    return model_dir


# As the AWS PyTorch inference toolkit's default model_fn picks its device: ``cuda:{gpu_id}`` from MMS's gpu_id.
TOOLKIT_STYLE_SCRIPT = """
import json
import os

import torch


def model_fn(model_dir, context):
    gpu_id = context.system_properties.get("gpu_id")
    device = torch.device(f"cuda:{gpu_id}" if gpu_id is not None and torch.cuda.is_available() else "cpu")
    return torch.jit.load(os.path.join(model_dir, "model.pt"), map_location=device)


def predict_fn(data, model, context):
    device = next(model.parameters()).device
    with torch.no_grad():
        scores = model(data.to(device))
    return {
        "scores": scores.tolist(),
        "pid": os.getpid(),
        "gpu_id": context.gpu_id,
        "system_gpu_id": context.system_properties["gpu_id"],
        "parameter_device": str(device),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def output_fn(prediction, accept, context):
    return json.dumps(prediction), "application/json"
"""


def toolkit_style_model(model_dir: Path) -> Path:
    """TorchScript weights with a script that places the model on ``cuda:{gpu_id}`` itself, in ``model_fn``."""
    torchscript_model(model_dir)
    write_code(model_dir, TOOLKIT_STYLE_SCRIPT)
    return model_dir


S3_CODE_SCRIPT = """
import json

import torch

VERSION = "{version}"


def model_fn(model_dir):
    return torch.jit.load(model_dir + "/model.pt", map_location="cpu")


def transform_fn(model, body, content_type, accept):
    data = torch.tensor(json.loads(body), dtype=torch.float32)
    with torch.inference_mode():
        return json.dumps({{"version": VERSION, "scores": model(data).tolist()}})
"""


def code_archive(path: Path, version: str, requirements: str | None = None) -> Path:
    """A ``code.tar.gz`` as SageMaker's SDK uploads it: ``inference.py`` (and ``requirements.txt``) at the root."""
    import io
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    files = {"inference.py": S3_CODE_SCRIPT.format(version=version)}
    if requirements is not None:
        files["requirements.txt"] = requirements
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


# Row-wise contract functions for dynamic batching: the defaults decode and encode; predict_fn logs each forward
# pass's rows (so tests see batches form), can be slowed so that batches form even on this tiny model, and can be
# told to misbehave by files in the model directory.
BATCHING_SCRIPT = """
import os
import time

import torch

OUT_OF_MEMORY_ABOVE = "out_of_memory_above"  # file holding a row count: larger batches raise CUDA's OOM error
SLEEP_SECONDS = "sleep_seconds"  # file holding how long each pass takes, over MME_TEST_PREDICT_SLEEP


def predict_fn(data, model, context):
    model_dir = context.model_dir
    cuda_bytes = torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0
    with open(os.path.join(model_dir, "batches.log"), "a") as log:
        log.write(f"{os.getpid()} {data.shape[0]} {context.batch_size} {cuda_bytes}\\n")
    limit = os.path.join(model_dir, OUT_OF_MEMORY_ABOVE)
    if os.path.exists(limit) and data.shape[0] > int(open(limit).read()):
        raise torch.cuda.OutOfMemoryError(f"test double: no memory for {data.shape[0]} rows")
    sleep = os.path.join(model_dir, SLEEP_SECONDS)
    time.sleep(float(open(sleep).read() if os.path.exists(sleep) else os.environ.get("MME_TEST_PREDICT_SLEEP", "0")))
    with torch.inference_mode():
        prediction = model(data.to(context.device))
    if os.path.exists(os.path.join(model_dir, "drop_a_row")) and data.shape[0] > 1:
        return prediction[:-1]
    return prediction
"""


def batching_model(
    model_dir: Path,
    batch_size: int | None = 8,
    max_batch_delay_ms: int | None = None,
    seed: int = 0,
    code: bool = True,
) -> Path:
    """The tiny TorchScript model with ``serving.properties``, and (``code``) a row-wise ``predict_fn`` that logs its
    batches; without it, the defaults serve it."""
    torchscript_model(model_dir, seed)
    if code:
        write_code(model_dir, BATCHING_SCRIPT)
    lines = [f"batch_size={batch_size}"] if batch_size is not None else []
    if max_batch_delay_ms is not None:
        lines.append(f"max_batch_delay={max_batch_delay_ms}")
    (model_dir / "serving.properties").write_text("\n".join(["# written by the tests", *lines]) + "\n")
    return model_dir


class ForwardPass(NamedTuple):
    """One forward pass of ``batching_model``, as its predict_fn logged it."""

    pid: int
    rows: int
    batch_size: int  # context.batch_size: the configured size
    cuda_bytes: int  # torch.cuda.memory_allocated() in the executor (0 without CUDA)


def batches(model_dir: Path) -> list[ForwardPass]:
    """The forward passes ``batching_model`` ran, in order."""
    log = model_dir / "batches.log"
    if not log.exists():
        return []
    return [ForwardPass(*map(int, line.split())) for line in log.read_text().splitlines()]


class SmallConvNet(torch.nn.Module):
    """A conv net small enough to compile in seconds: images of 3x16x16 to 5 scores."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.conv(x)).mean(dim=(2, 3))
        return torch.softmax(self.head(features), dim=-1)


PT2_NETS = {"mlp": (tiny_net, (3, IN_FEATURES)), "conv": (lambda seed: SmallConvNet().eval(), (3, 3, 16, 16))}


def pt2_model(model_dir: Path, net: str = "mlp", aoti: bool = False, seed: int = 0) -> torch.nn.Module:
    """``model.pt2`` with no code: ``net`` exported with a dynamic batch dimension, saved as an ExportedProgram or
    compiled for the CPU as an AOTInductor package. Returns the eager model, to compare answers with."""
    build, example_shape = PT2_NETS[net]
    torch.manual_seed(seed)
    model = build(seed)
    example = torch.randn(*example_shape)
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(model, (example,), dynamic_shapes={"x": {0: batch}})
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "model.pt2"
    if aoti:
        # What package_model.py --aot records: the rows the package takes, so that others get a 400.
        options = {"aot_inductor.metadata": input_metadata(example.shape[1:], example.dtype)}
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=options)
    else:
        torch.export.save(program, str(path))
    return model

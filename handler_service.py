"""The handler MMS calls (``handler_service:handle``): the SageMaker contract with PyTorch defaults.

A loader calls ``preload`` once per model in its CUDA-free process (model to host memory); a device
host calls ``attach`` once its GPU is bound, then ``start_batcher``, and ``handle`` from one thread
per frontend connection. Plain MMS calls ``handle(None, context)`` to initialise, which does both in
its worker.
"""

from __future__ import annotations

from typing import Any

import torch
from mms.service import Service
from sagemaker_inference.default_handler_service import DefaultHandlerService

from inference_handler import DefaultPytorchInferenceHandler
from mme_runtime.base import devices
from mme_runtime.base.config import Config
from mme_runtime.base.devices import worker_device
from mme_runtime.huggingface import defaults as hugging_face
from mme_runtime.models.loading import LoadedModel, ModelSpec, ResolvedModel
from mme_runtime.models.serving_properties import ServingSettings
from mme_runtime.serving.served_model import ServedModel

hugging_face.register()  # so every process that loads a model with this handler serves them


class HandlerService(DefaultHandlerService):  # type: ignore[misc]
    """One model's handler: load once, place once, then transform each request."""

    def __init__(self, config: Config | None = None) -> None:
        config = config or Config.from_process_env()
        super().__init__(transformer=ServedModel(DefaultPytorchInferenceHandler(), config))

    @property
    def served(self) -> ServedModel:
        return self._service  # type: ignore[no-any-return]

    def preload(self, context: Any, resolved: ResolvedModel | None = None) -> None:
        """Runs the user's ``model_fn`` on the host; must not touch CUDA (the server forks
        afterwards)."""
        self.served.load(context, torch.device("cpu"), resolved)

    def attach(self, context: Any, resolved: ResolvedModel | None = None) -> None:
        """Places the model on this device host's device (``gpu_id`` is its CUDA ordinal here) and
        warms it up."""
        self.served.attach(
            context, worker_device(context.system_properties.get("gpu_id")), resolved
        )

    def start_batcher(self) -> ServingSettings:
        """The host serves many connections from threads: forward passes go through one batcher from
        now on."""
        return self.served.start_batcher()

    def initialize(self, context: Any) -> None:
        """MMS's contract: everything in the worker (the toolkit's PYTHONPATH edit is not
        needed)."""
        self.attach(context)

    def handle(self, data: list[Any], context: Any) -> list[bytes]:
        return self.served.transform(data, context)

    def entry_point(self, data: list[Any] | None, context: Any) -> list[bytes] | None:
        """MMS's entry point for this handler: ``data is None`` asks to initialise."""
        if data is None:
            self.initialize(context)
            return None
        return self.handle(data, context)


_service: HandlerService | None = None


def service() -> HandlerService:
    """This process's handler, created on first use (never at import, so importing reads no
    settings)."""
    global _service
    if _service is None:
        _service = HandlerService()
    return _service


def preload(context: Any, resolved: ResolvedModel | None = None) -> None:
    service().preload(context, resolved)


def attach(context: Any) -> None:
    service().attach(context)


def start_batcher() -> ServingSettings:
    return service().start_batcher()


def handle(data: list[Any] | None, context: Any) -> list[bytes] | None:
    """MMS's function entry point: ``data is None`` asks to initialise."""
    return service().entry_point(data, context)


def model_handler(
    spec: ModelSpec, config: Config, gpu: int | None, ordinal: int | None, batch_size: int
) -> LoadedModel:
    """A handler of the model's own in a device host (the module-level one of ``handle`` is one per
    process), wrapped in MMS's ``Service`` as MMS's own worker's is."""
    handler = HandlerService(config)
    wrapped = Service(spec.name, spec.model_dir, None, handler.entry_point, ordinal, batch_size)
    devices.record_gpu(wrapped.context.system_properties, gpu, ordinal)
    return LoadedModel(handler, wrapped)

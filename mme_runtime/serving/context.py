"""The ``context`` user functions receive: MMS's context API plus the model's device and the
request's headers.

Existing scripts keep using ``context.system_properties[...]`` and ``context.get_request_header(idx,
name)``; new code can read ``context.device``, ``context.gpu_id``, ``context.request_headers`` and
the rest directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mme_runtime.base.devices import ASSIGNED_GPU_ID

CUSTOM_ATTRIBUTES = "x-amzn-sagemaker-custom-attributes"


class InferenceContext:
    """A view of MMS's ``Context`` for one model, or for one request of a batch
    (``request_index``)."""

    def __init__(
        self, mms_context: Any, device: torch.device, request_index: int | None = None
    ) -> None:
        self._mms = mms_context
        self.device = device
        self.request_index = request_index
        self._headers: dict[str, str] | None = None

    def for_request(self, index: int) -> InferenceContext:
        return InferenceContext(self._mms, self.device, index)

    @property
    def mms_context(self) -> Any:
        return self._mms

    @property
    def model_name(self) -> str:
        return str(self._mms.model_name)

    @property
    def model_dir(self) -> str:
        return str(self._mms.system_properties.get("model_dir"))

    @property
    def gpu_id(self) -> int | None:
        """The GPU the frontend assigned this device host (an nvidia-smi index), None on the CPU.

        ``system_properties["gpu_id"]`` is the CUDA ordinal of that GPU inside this host instead (0
        in our hosts, which see only their GPU), so that ``cuda:{gpu_id}`` in existing scripts names
        the right card.
        """
        properties = self._mms.system_properties
        gpu = properties.get(ASSIGNED_GPU_ID, properties.get("gpu_id"))
        return None if gpu is None else int(gpu)

    @property
    def batch_size(self) -> int:
        return int(self._mms.system_properties.get("batch_size") or 1)

    @property
    def request_id(self) -> str | None:
        if self.request_index is None or not self._mms.request_ids:
            return None
        request_id = self._mms.request_ids.get(self.request_index)
        return None if request_id is None else str(request_id)

    @property
    def request_headers(self) -> Mapping[str, str]:
        """This request's HTTP headers, keys in lower case."""
        if self._headers is None:
            self._headers = {}
            if self.request_index is not None and self._mms.request_processor:
                properties = self._mms.request_processor[
                    self.request_index
                ].get_request_properties()
                self._headers = {k.lower(): v for k, v in properties.items() if isinstance(v, str)}
        return self._headers

    def header(self, name: str) -> str | None:
        return self.request_headers.get(name.lower())

    @property
    def custom_attributes(self) -> str | None:
        """``X-Amzn-SageMaker-Custom-Attributes`` of this request (``CustomAttributes`` in
        ``invoke_endpoint``)."""
        return self.header(CUSTOM_ATTRIBUTES)

    def __getattr__(self, name: str) -> Any:
        # Everything else is MMS's context API: system_properties, get_request_header,
        # set_response_status, ...
        return getattr(self._mms, name)

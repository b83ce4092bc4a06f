"""The error family: each error knows the HTTP status it answers with.

Built on the toolkit's ``BaseInferenceToolkitError`` so user code that raises toolkit errors keeps
working. User code picks its own 4xx by raising ``ContainerError`` subclasses or
``BaseInferenceToolkitError``.
"""

from __future__ import annotations

from sagemaker_inference.errors import BaseInferenceToolkitError

# Exit codes of the entrypoint, as in gunicorn: distinct so that an operator can tell why it
# stopped.
EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_BOOT = 3


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (torch's often run to pages), or its type when it
    has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class ContainerError(BaseInferenceToolkitError):  # type: ignore[misc]
    """An error with an HTTP status; its message is safe to show to the client. ``trace``: what user
    code raised, whose traceback the log shows (never the client)."""

    status = 500

    def __init__(
        self, message: str, status: int | None = None, trace: BaseException | None = None
    ) -> None:
        code = status if status is not None else self.status
        super().__init__(code, message, message)
        self.status = code
        self.trace = trace

    def __str__(self) -> str:
        return str(self.message)


class InvalidInput(ContainerError):
    """The payload cannot be decoded (malformed JSON, CSV or NPY, bad encoding)."""

    status = 400


class UnsupportedContentType(ContainerError):
    status = 415


class UnsupportedAccept(ContainerError):
    status = 406


class PayloadTooLarge(ContainerError):
    status = 413


class ModelLoadError(ContainerError):
    """``model_fn`` (or the default loader) could not produce a model."""

    status = 500


class InsufficientMemory(ContainerError):
    """Not enough host or device memory; SageMaker evicts models and retries on 507."""

    status = 507


class RequestTimeout(ContainerError):
    """A request not answered within ``SAGEMAKER_MODEL_SERVER_TIMEOUT``: the caller is answered, the
    call runs on."""

    status = 504


class ConfigError(Exception):
    """Bad settings; raised at boot, mapped to ``EXIT_CONFIG`` by the entrypoint."""

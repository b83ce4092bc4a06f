"""One model in a device host (``device_host.py``): its handler once loaded (or why it failed), its
connections, and what its memory borrows from the host's other models."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

from mme_runtime.models.loading import LoadedModel, LoadFailure, ModelSpec, ResolvedModel
from mme_runtime.operations.metric_series import Series
from mme_runtime.serving.connection import Assignment, ConnectionDemand


@dataclass
class HostedModel:
    """One model in the host: its handler once loaded, or why it failed, and the connections that
    wait or run."""

    spec: ModelSpec
    slot: int
    series: Series | None  # its metrics
    loaded: LoadedModel | None = None
    failure: LoadFailure | None = None
    waiting: list[tuple[socket.socket, Assignment, bool]] = field(default_factory=list)
    connections: set[socket.socket] = field(default_factory=set)
    turns: int = 0  # messages being answered
    closing: bool = False  # its UNLOAD began: no more messages are answered
    turns_ended: threading.Condition = field(default_factory=threading.Condition)
    # a batching model's busy connections, to open more (serving/connection.py)
    demand: ConnectionDemand | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    loading: threading.Thread | None = None
    # its tensors in host memory that another model brought (held once, theirs)
    borrowed_host_bytes: int = 0
    borrowed_device_bytes: int = 0  # the same on its GPU
    # it took the very model another one here unpacked (one package: all of it theirs)
    borrows_all: bool = False
    # when its LOAD began (wall clock, the warm process's): its load time is counted from it
    started: float = 0.0
    moved: bool = False  # loaded for a host's hand-over: no LOAD of the model's
    load_seconds: float | None = None  # a moved model's LOAD's, as its first host took it
    # the UNLOAD of a model of the same name, to end before this one loads
    after: threading.Event | None = None
    package_unused: bool = False  # its package was made with other code: model_fn ran here
    # the model as its loader resolved it (None: resolved here)
    resolved: ResolvedModel | None = None

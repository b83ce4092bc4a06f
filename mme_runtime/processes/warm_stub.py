"""The stub's side of warm start: runs in the process MMS started for a model, so it imports almost nothing (every
model pays for this process: importing ``config`` alone would cost it 13 MiB).

The stub hands its command line, environment and stdio to the warm process. For an isolated model the warm process
answers with its server's pid: the stub forwards SIGTERM and SIGINT to it and exits with its status. For a shared
model it answers ``shared``: the stub then becomes ``cat`` reading its connection, a process of a few hundred KiB
that MMS can kill to UNLOAD (the warm process sees the connection close) and that exits when the warm process
closes it (the model's server ended: MMS starts the model again).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from types import FrameType

from mme_runtime.processes.warm_protocol import receive, send

STUB_TITLE = "mme-model-stub"


def run_via_warm_process(socket_path: str, environment: dict[str, str]) -> int | None:
    """Asks the warm process to serve our model; None if there is no warm process (the stub then serves it).
    ``environment`` is the stub's, which the model's processes take."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(socket_path)
    except OSError:
        client.close()
        return None
    request = {"argv": sys.argv, "env": environment, "cwd": os.getcwd(), "pid": os.getpid()}
    send(client, request, [0, 1, 2])
    reply, _ = receive(client)
    if reply is None:
        return None
    if reply.get("shared"):
        _become_cat(client, sys.argv)
    if "pid" not in reply:
        return None
    server_pid = int(reply["pid"])

    def forward(signum: int, _frame: FrameType | None) -> None:
        try:
            os.kill(server_pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    while True:
        try:
            message, _ = receive(client)
        except InterruptedError:
            continue
        if message is None:  # the warm process died: so did our server's supervisor, treat it as a crash
            return 1
        if "exit" in message:
            return int(message["exit"])


def _become_cat(client: socket.socket, argv: list[str]) -> None:
    """Replaces this Python process by ``cat`` reading the warm process's connection; never returns. Its title (cat's
    ``argv[0]``, which it only prints in errors) names the model, as the Python stub's command line did."""
    sys.stdout.flush()
    os.dup2(client.fileno(), 0)
    # Nothing more is logged through the stub: MMS's threads reading its pipes end once the warm process lets go too.
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    os.close(quiet)
    model = argv[argv.index("--model-name") + 1] if "--model-name" in argv else "?"
    os.execvp("cat", [f"{STUB_TITLE} --model-name {model}"])

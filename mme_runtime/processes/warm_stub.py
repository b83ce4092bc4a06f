"""The stub's side of warm start: runs in the process MMS started for a model, so it imports almost
nothing (every model pays for this process: importing ``config`` alone would cost it 13 MiB).

The stub hands its command line, environment and stdio to the warm process, which answers ``shared``
once the model is ready to take connections; the stub then becomes ``cat`` reading its connection, a
process of a few hundred KiB that MMS can kill to UNLOAD (the warm process sees the connection
close) and that exits when the warm process closes it (MMS then starts the model again).
"""

from __future__ import annotations

import os
import socket
import sys

from mme_runtime.processes.warm_protocol import receive, send

STUB_TITLE = "mme-model-stub"


def run_via_warm_process(socket_path: str, environment: dict[str, str]) -> int:
    """Asks the warm process to serve our model and becomes ``cat`` once it takes it (never returns
    then); 1, with the cause on stderr, if there is no warm process or it ends first.
    ``environment`` is the stub's, which the model's processes take."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(socket_path)
    except OSError as exc:
        print(f"mme-gpu: no warm process at {socket_path}: {exc}", file=sys.stderr, flush=True)
        return 1
    request = {"argv": sys.argv, "env": environment, "cwd": os.getcwd(), "pid": os.getpid()}
    send(client, request, [0, 1, 2])
    reply, _ = receive(client)
    if reply is None or not reply.get("shared"):
        print(
            "mme-gpu: the warm process ended before it took the model", file=sys.stderr, flush=True
        )
        return 1
    _become_cat(client, sys.argv)
    return 1  # not reached: _become_cat replaces this process


def _become_cat(client: socket.socket, argv: list[str]) -> None:
    """Replaces this Python process by ``cat`` reading the warm process's connection; never returns.
    Its title (cat's ``argv[0]``, which it only prints in errors) names the model, as the Python
    stub's command line did."""
    sys.stdout.flush()
    os.dup2(client.fileno(), 0)
    # Nothing more is logged through the stub: MMS's threads reading its pipes end once the warm
    # process lets go too.
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    os.close(quiet)
    model = argv[argv.index("--model-name") + 1] if "--model-name" in argv else "?"
    os.execvp("cat", [f"{STUB_TITLE} --model-name {model}"])

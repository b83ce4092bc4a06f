"""The stub's side of warm start: runs in the process MMS started for a model, so it imports almost
nothing (every model pays for this process: importing ``config`` alone would cost it 13 MiB).

The stub hands its command line, environment and stdio to the warm process, which answers ``shared``
once the model is ready to take connections; the stub then becomes ``head -c 1`` reading its
connection, with no other descriptor: a process of a few hundred KiB that MMS can kill to UNLOAD
(the warm process sees the connection close) and that exits when the warm process closes it (MMS
then starts the model again). Nothing is written to it after ``shared``.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from mme_runtime.processes.warm_protocol import STARTING_FILE, WARM_START_SECONDS, receive, send

STUB_TITLE = "mme-model-stub"


def run_via_warm_process(socket_path: str, environment: dict[str, str]) -> int:
    """Asks the warm process to serve our model and becomes ``head -c 1`` once it takes it (never
    returns then); 1, with the cause on stderr, if there is no warm process or it ends first.
    ``environment`` is the stub's, which the model's processes take."""
    client = _connect(socket_path)
    if client is None:
        return 1
    request = {"argv": sys.argv, "env": environment, "cwd": os.getcwd(), "pid": os.getpid()}
    send(client, request, [0, 1, 2])
    reply, _ = receive(client)
    if reply is None or not reply.get("shared"):
        print(
            "mme-gpu: the warm process ended before it took the model", file=sys.stderr, flush=True
        )
        return 1
    _become_reader(client, sys.argv)
    return 1  # not reached: _become_reader replaces this process


def _connect(socket_path: str) -> socket.socket | None:
    """A connection to the warm process; None, with the cause on stderr, if there is none. While it
    starts (``STARTING_FILE``: MMS starts meanwhile, and may start a model first), waits for it."""
    starting = os.path.join(os.path.dirname(socket_path), STARTING_FILE)
    deadline = time.monotonic() + WARM_START_SECONDS
    waiting = True
    while True:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.connect(socket_path)
            return client
        except OSError as exc:
            client.close()
            if not waiting or time.monotonic() > deadline:
                cause = f"mme-gpu: no warm process at {socket_path}: {exc}"
                print(cause, file=sys.stderr, flush=True)
                return None
            # once the file has gone, one more try: it goes as the warm process accepts
            waiting = os.path.exists(starting)
            if waiting:
                time.sleep(0.05)


def _become_reader(client: socket.socket, argv: list[str]) -> None:
    """Replaces this Python process by ``head -c 1`` reading the warm process's connection, its
    only descriptor; never returns. ``head`` (unlike ``cat``, which checks its stdout first) needs
    no stdout until it has read something, and it never will: MMS's threads reading the stub's
    pipes end once the warm process lets go of them too, and at thousands of models each
    descriptor counts. Its title (``argv[0]``) names the model, as the Python stub's command line
    did."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(client.fileno(), 0)
    client.close()
    for fd in (1, 2):
        os.close(fd)
    model = argv[argv.index("--model-name") + 1] if "--model-name" in argv else "?"
    os.execvp("head", [f"{STUB_TITLE} --model-name {model}", "-c", "1"])

"""A device host's connections wait in one epoll set and take turns on worker threads (``serving/connection.py``):
each connection's messages answered in order and to it alone, its threads gone once nothing happens, a connection
whose turn fails or ends closed without harming the others."""

from __future__ import annotations

import functools
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import pytest

from mme_runtime.serving.connection import SPARE_WORKERS, Turns


def echo_turn(connection: socket.socket) -> bool:
    """Answers one line with itself upper-cased; False when the peer has gone."""
    data = connection.recv(64)
    if not data:
        return False
    connection.sendall(data.upper())
    return True


def wait_until(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made: list[tuple[socket.socket, socket.socket]] = []
    yield made
    for ours, theirs in made:
        ours.close()
        theirs.close()


def connect(turns: Turns, pairs: list[tuple[socket.socket, socket.socket]], turn: Callable[..., bool]) -> socket.socket:
    ours, theirs = socket.socketpair()
    pairs.append((ours, theirs))
    theirs.settimeout(5)
    turns.add(ours, turn)
    return theirs


def test_many_clients_each_get_their_own_answers_in_order(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    turns = Turns("test")
    clients = [connect(turns, pairs, echo_turn) for _ in range(32)]
    answers: dict[int, list[bytes]] = {i: [] for i in range(len(clients))}

    def talk(index: int) -> None:
        for round_ in range(20):
            clients[index].sendall(f"c{index}r{round_}".encode())
            answers[index].append(clients[index].recv(64))

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, got in answers.items():
        assert got == [f"C{index}R{round_}".encode() for round_ in range(20)]


def test_idle_connections_hold_no_worker(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    turns = Turns("test", idle_seconds=0.2)
    before = threading.active_count()
    clients = [connect(turns, pairs, echo_turn) for _ in range(50)]
    for client in clients:
        client.sendall(b"x")
    assert [client.recv(8) for client in clients] == [b"X"] * 50
    assert wait_until(lambda: turns.workers == SPARE_WORKERS)
    assert threading.active_count() <= before  # the 50 connections still open, watched by the spare workers
    clients[7].sendall(b"again")  # and served again, by a new worker
    assert clients[7].recv(8) == b"AGAIN"


def test_a_failing_or_ended_turn_closes_its_connection_alone(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    turns = Turns("test")

    def failing(connection: socket.socket) -> bool:
        connection.recv(64)
        raise RuntimeError("boom")

    healthy = connect(turns, pairs, echo_turn)
    broken = connect(turns, pairs, failing)
    leaving = connect(turns, pairs, echo_turn)
    broken.sendall(b"x")
    assert broken.recv(8) == b""  # closed by the server
    leaving.close()
    healthy.sendall(b"still")
    assert healthy.recv(8) == b"STILL"
    assert wait_until(lambda: turns.connections == 1)


def test_turns_of_different_connections_run_side_by_side(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    """A long turn holds no other connection back: four turns that each wait for the other three all finish."""
    together = threading.Barrier(4, timeout=5)

    def meet(connection: socket.socket) -> bool:
        connection.recv(8)
        together.wait()
        connection.sendall(b"met")
        return True

    turns = Turns("test")
    clients = [connect(turns, pairs, meet) for _ in range(4)]
    for client in clients:
        client.sendall(b"x")
    assert [client.recv(8) for client in clients] == [b"met"] * 4


class Model:
    """What a connection's turn works for (a device host's model)."""


def test_a_waiting_worker_holds_nothing_of_the_connection_it_served_last(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    # A worker kept its last turn, and through it that model, while it waited: after a mass UNLOAD, a model per
    # worker with its metrics stayed in the host (issue #37).
    turns = Turns("holds")
    model = Model()
    gone = weakref.ref(model)
    client = connect(turns, pairs, functools.partial(lambda model, connection: False, model))  # its last turn
    del model
    client.sendall(b"x")
    assert wait_until(lambda: turns.connections == 0)
    assert wait_until(lambda: gone() is None) and turns.workers == SPARE_WORKERS


def test_a_released_connection_leaves_between_two_turns_open_with_its_next_message_unread(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    # A drained host hands its connections to a fresh one (host_recycling.py): a turn running when the release
    # comes ends first, and a message sent after it waits in the socket for the next process, unanswered here.
    started, finish = threading.Event(), threading.Event()

    def slow_echo(connection: socket.socket) -> bool:
        data = connection.recv(64)
        if not data:
            return False
        started.set()
        finish.wait(5)
        connection.sendall(data.upper())
        return True

    turns = Turns("test")
    client = connect(turns, pairs, slow_echo)
    ours = pairs[-1][0]
    client.sendall(b"first")
    assert started.wait(5)
    released = threading.Thread(target=turns.release, args=(ours,))
    released.start()
    time.sleep(0.2)
    assert released.is_alive()  # its turn still runs
    finish.set()
    released.join(5)
    assert not released.is_alive()
    assert client.recv(64) == b"FIRST"
    assert turns.connections == 0
    client.sendall(b"second")
    time.sleep(0.3)  # no worker takes it
    ours.setblocking(False)
    assert ours.recv(64) == b"second"  # open, and the message is the next process's to read
    ours.setblocking(True)
    other = connect(turns, pairs, echo_turn)  # the set still serves the others
    other.sendall(b"ok")
    assert other.recv(64) == b"OK"


def test_a_released_idle_connection_is_never_answered_again(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    turns = Turns("test")
    client = connect(turns, pairs, echo_turn)
    client.sendall(b"one")
    assert client.recv(64) == b"ONE"
    turns.release(pairs[-1][0])
    client.sendall(b"two")
    client.settimeout(0.5)
    with pytest.raises(TimeoutError):
        client.recv(64)
    assert pairs[-1][0].recv(64) == b"two"


def test_a_connection_that_ended_is_not_released_and_a_running_one_is_released_once(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    turns = Turns("test")
    client = connect(turns, pairs, echo_turn)
    ours = pairs[-1][0]
    client.close()  # its turn reads nothing: the connection ends and is closed here
    assert wait_until(lambda: turns.connections == 0)
    assert ours.fileno() == -1
    assert turns.release(ours) is False  # nothing of it to hand over
    # a turn that ends its connection while a release waits for it: the release gets it, open, and no worker closes it
    started, finish = threading.Event(), threading.Event()

    def ends(connection: socket.socket) -> bool:
        connection.recv(64)
        started.set()
        finish.wait(5)
        return False

    client = connect(turns, pairs, ends)
    ours = pairs[-1][0]
    client.sendall(b"x")
    assert started.wait(5)
    released: list[bool] = []
    releasing = threading.Thread(target=lambda: released.append(turns.release(ours)))
    releasing.start()
    time.sleep(0.1)
    finish.set()
    releasing.join(5)
    assert released == [True]
    assert ours.fileno() != -1

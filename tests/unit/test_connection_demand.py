"""A batching model asks for its whole batch's connections the first time the ones it opened at LOAD are all busy,
and only then: not while the LOAD's connections are still opening, not for one request at a time, not twice."""

from __future__ import annotations

from mme_runtime.serving.connection import ConnectionDemand


def demand_with_asks(at_load: int = 2, full: int = 16) -> tuple[ConnectionDemand, list[int]]:
    asks: list[int] = []
    return ConnectionDemand(asks.append, at_load, full), asks


def test_one_request_at_a_time_never_asks() -> None:
    demand, asks = demand_with_asks()
    demand.opened()
    demand.opened()
    for _ in range(100):
        with demand.answering():
            pass
    assert asks == []


def test_the_first_request_while_every_connection_is_busy_asks_for_the_whole_batch_once() -> None:
    demand, asks = demand_with_asks()
    demand.opened()
    demand.opened()
    with demand.answering():
        assert asks == []
        with demand.answering():
            assert asks == [16]
    with demand.answering(), demand.answering():
        pass
    assert asks == [16]


def test_the_lone_first_connection_does_not_count_as_busy() -> None:
    # The LOAD's own connection serves before the scaler opens the second one: a request there fills it alone.
    demand, asks = demand_with_asks()
    demand.opened()
    with demand.answering():
        pass
    demand.closed()
    assert asks == [] and demand.connections == 0


def test_a_model_that_opened_its_whole_batch_at_load_never_asks() -> None:
    demand, asks = demand_with_asks(at_load=8, full=8)
    demand.opened()
    with demand.answering():
        pass
    assert asks == []

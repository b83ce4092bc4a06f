"""``CpuPool``: which of the CPU's shared hosts serves a model, chosen from counts kept as models come
and go (issue #37: no scan of every model per LOAD)."""

from __future__ import annotations

from mme_runtime.processes.device_hosts import CpuPool


def test_a_model_goes_to_the_host_with_the_fewest_models_the_first_on_a_tie() -> None:
    pool = CpuPool(2)
    assert [pool.host_for(f"m{index}", None) for index in range(4)] == [
        "cpu=0",
        "cpu=1",
        "cpu=0",
        "cpu=1",
    ]
    assert pool.host_for("m0", None) == "cpu=0"  # chosen once
    pool.leave("m0")
    pool.leave("m2")
    assert pool.models_on == {"cpu=0": 0, "cpu=1": 2}
    assert pool.host_for("m5", None) == "cpu=0"
    pool.leave("never-placed")  # nothing to do


def test_a_model_goes_where_its_artifacts_are_served_under_another_name_until_they_leave() -> None:
    pool = CpuPool(2)
    assert pool.host_for("a", ("model.pt", 1, 2)) == "cpu=0"
    assert pool.host_for("a-again", ("model.pt", 1, 2)) == "cpu=0"  # not the emptier cpu=1
    pool.leave("a")
    pool.leave("a-again")
    assert pool.host_for("b", None) == "cpu=0"
    assert pool.host_for("a-third", ("model.pt", 1, 2)) == "cpu=1"  # none left: the fewest


def test_a_choice_costs_the_same_with_thousands_of_models() -> None:
    pool = CpuPool(2)
    for index in range(5000):
        pool.host_for(f"m{index}", ("file", index, 0))
    assert pool.models_on == {"cpu=0": 2500, "cpu=1": 2500}
    for index in range(5000):
        pool.leave(f"m{index}")
    assert pool.models_on == {"cpu=0": 0, "cpu=1": 0}
    assert not pool._by_artifacts  # nothing kept for models gone

"""The package cache's keeping of unloaded models' packages: kept under their name and files, least recently used
out first beyond ``MME_KEEP_UNLOADED_MB``, given up for a LOAD that needs the memory, and keyed anew when a file
changes. Real packages (shared-memory files) throughout; the end-to-end re-LOAD is tests/integration/test_reload.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mme_runtime.base.config import Config
from mme_runtime.models import package_cache
from mme_runtime.models.loading import ModelSpec
from mme_runtime.models.model_package import Package, pack
from mme_runtime.models.package_cache import PackageCache

MIB = 1 << 20


def spec(name: str, model_dir: Path) -> ModelSpec:
    return ModelSpec(name=name, model_dir=str(model_dir), handler="handler_service", tmp_dir="/tmp")


def user_code_model(model_dir: Path) -> Path:
    """A directory with inference code: no other name may share its package, only its own re-LOAD."""
    (model_dir / "code").mkdir(parents=True)
    (model_dir / "code" / "inference.py").write_text("def model_fn(model_dir):\n    return None\n")
    (model_dir / "model.pth").write_bytes(b"\0" * 1024)
    return model_dir


def package_of(megabytes: int) -> Package:
    return pack(torch.nn.Linear(megabytes * MIB // 4 // 256, 256, bias=False), "m", hashed=False)


class Released(list[Package]):
    def __call__(self, package: Package) -> None:
        package.close()
        self.append(package)


@pytest.fixture
def released() -> Released:
    return Released()


def loaded(cache: PackageCache, name: str, model_dir: Path, megabytes: int = 1) -> tuple[tuple[str, int, int], Package]:
    key = cache.key(spec(name, model_dir))
    assert key is not None
    assert cache.take(key, name) is None
    return key, cache.add(key, name, package_of(megabytes))


def test_an_unloaded_package_is_kept_and_taken_again_by_the_same_name_and_files(
    tmp_path: Path, released: Released
) -> None:
    cache = PackageCache(Config(), released)
    model_dir = user_code_model(tmp_path / "a")
    key, package = loaded(cache, "a", model_dir)
    cache.release(key, "a")
    assert released == [] and cache.kept_bytes >= MIB
    assert cache.key(spec("a", model_dir)) == key
    assert cache.take(key, "a") is package
    assert cache.kept_bytes == 0  # in use again
    assert cache.key(spec("b", model_dir)) != key  # another name runs its own model_fn: user code may differ by name


def test_a_changed_file_is_another_key(tmp_path: Path, released: Released) -> None:
    cache = PackageCache(Config(), released)
    model_dir = user_code_model(tmp_path / "a")
    key = cache.key(spec("a", model_dir))
    script = model_dir / "code" / "inference.py"
    os.utime(script, ns=(0, script.stat().st_mtime_ns + 1))  # same size, newer
    assert cache.key(spec("a", model_dir)) != key
    newer = cache.key(spec("a", model_dir))
    (model_dir / "extra.json").write_text("{}")
    assert cache.key(spec("a", model_dir)) != newer


def test_kept_packages_beyond_the_limit_go_least_recently_used_first(tmp_path: Path, released: Released) -> None:
    cache = PackageCache(Config(keep_unloaded_mb=5), released)
    keys = {name: loaded(cache, name, user_code_model(tmp_path / name), megabytes=2) for name in "abc"}
    for name in "abc":
        cache.release(keys[name][0], name)
    # 3 x 2 MiB > 5 MiB: a, unloaded first, goes; b and c stay.
    assert released == [keys["a"][1]]
    assert cache.take(keys["b"][0], "b") is keys["b"][1]
    cache.release(keys["b"][0], "b")  # b is now the most recently used
    key_d, _ = loaded(cache, "d", user_code_model(tmp_path / "d"), megabytes=2)
    cache.release(key_d, "d")
    assert released == [keys["a"][1], keys["c"][1]]


def test_a_load_that_needs_the_memory_takes_it_from_kept_packages(
    tmp_path: Path, released: Released, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = PackageCache(Config(memory_headroom_mb=0), released)
    keys = {name: loaded(cache, name, user_code_model(tmp_path / name), megabytes=2) for name in "ab"}
    for name in "ab":
        cache.release(keys[name][0], name)
    in_use_key, in_use = loaded(cache, "in-use", user_code_model(tmp_path / "in-use"), megabytes=2)
    # Each release frees what its package held; the host's available memory follows.
    monkeypatch.setattr(package_cache, "available_bytes", lambda: (4 * MIB - cache.kept_bytes, "on the host"))
    big = tmp_path / "big"
    big.mkdir()
    (big / "model.pt").write_bytes(b"\0" * 3 * MIB)  # 3 MiB needed, none available: a, then b go
    cache.make_room(spec("big", big))
    assert released == [keys["a"][1], keys["b"][1]]
    cache.make_room(spec("big", big))  # nothing left to give: the model in use keeps its package
    assert len(released) == 2 and cache.take(in_use_key, "in-use") is in_use


def test_keeping_off_keeps_nothing_but_the_same_artifacts_are_still_shared(tmp_path: Path, released: Released) -> None:
    cache = PackageCache(Config(keep_unloaded_mb=0), released)
    assert cache.key(spec("a", user_code_model(tmp_path / "a"))) is None
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.pt").write_bytes(b"\0" * 1024)
    key, package = loaded(cache, "one", plain)
    assert cache.key(spec("two", plain)) == key
    cache.release(key, "one")
    assert released == [package]


def test_a_container_limit_below_the_host_s_memory_is_what_a_load_may_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mme_runtime.base import failures
    from mme_runtime.operations import memory

    limit, current, stat = tmp_path / "memory.max", tmp_path / "memory.current", tmp_path / "memory.stat"
    limit.write_text(f"{512 * MIB}\n")
    current.write_text(f"{500 * MIB}\n")
    stat.write_text(f"anon {400 * MIB}\ninactive_file {40 * MIB}\nactive_file {60 * MIB}\n")
    monkeypatch.setattr(failures, "CGROUP_MEMORY", ((limit, current),))
    monkeypatch.setattr(memory, "CGROUP_MEMORY_STAT", ((stat, "inactive_file"),))
    # 12 MiB left under the limit, and 40 MiB of page cache the kernel gives back first.
    assert memory.available_bytes() == (52 * MIB, "of the container's 512 MiB limit")
    limit.write_text("max\n")  # no limit: the host's own available memory
    assert memory.available_bytes()[1] == "on the host"


def test_loads_still_running_count_toward_the_room_a_load_needs(
    tmp_path: Path, released: Released, monkeypatch: pytest.MonkeyPatch
) -> None:
    available = 512 * MIB  # fixed: the machine's own changes between two reads
    monkeypatch.setattr(package_cache, "available_bytes", lambda: (available, "on the host"))
    cache = PackageCache(Config(memory_headroom_mb=0), released)
    key, _ = loaded(cache, "a", user_code_model(tmp_path / "a"), megabytes=2)
    cache.release(key, "a")
    small = tmp_path / "small"
    small.mkdir()
    (small / "model.pt").write_bytes(b"\0" * MIB)
    assert cache.make_room(spec("small", small)) == MIB and not released  # this LOAD alone fits
    assert cache.make_room(spec("small", small), loading_bytes=available) == MIB  # beside the others, it does not
    assert len(released) == 1


def test_an_unload_reads_what_its_own_package_holds_not_every_kept_one(
    tmp_path: Path, released: Released, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Summing every kept file's size on each UNLOAD made a mass UNLOAD of thousands quadratic (issue #37).
    reads: list[str] = []
    held = package_cache._Entry.held_bytes.fget  # type: ignore[attr-defined]

    def counted(entry: package_cache._Entry) -> int:
        reads.append(next(iter(entry.users), "?"))
        return held(entry)  # type: ignore[no-any-return]

    monkeypatch.setattr(package_cache._Entry, "held_bytes", property(counted))
    cache = PackageCache(Config(keep_unloaded_mb=4), released)
    keys = {name: loaded(cache, name, user_code_model(tmp_path / name), megabytes=1) for name in "abcde"}
    for name in "abcd":
        cache.release(keys[name][0], name)
    assert len(reads) == 4  # each package's size read once, as it was unloaded
    # 4 packages of a little over 1 MiB > 4 MiB: a went; b, c and d are kept
    assert released == [keys["a"][1]]
    assert 3 * MIB <= cache.kept_bytes < 4 * MIB
    assert cache.take(keys["c"][0], "c") is keys["c"][1]
    assert 2 * MIB <= cache.kept_bytes < 3 * MIB  # c in use again
    cache.release(keys["e"][0], "e", keep=False)
    assert released == [keys["a"][1], keys["e"][1]]
    cache.release(keys["c"][0], "c")
    cache.release(keys["c"][0], "c")  # twice: nothing more
    assert 3 * MIB <= cache.kept_bytes < 4 * MIB
    assert len(reads) == 5

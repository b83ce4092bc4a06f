"""Tensors held once by content in the warm process: fine-tunes of one base share its tensors, what differs (by one
element, or only by a crafted digest) does not, UNLOAD in any order keeps what another model uses, and a write stays
in the model that made it."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from mme_runtime.models.model_package import Package, pack, unpack
from mme_runtime.models.tensor_store import TensorStore

MIB = 1 << 20


class FineTune(torch.nn.Module):
    """A 4 MiB frozen backbone and a small head of its own."""

    def __init__(self, head_seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Linear(1024, 1024)
        torch.manual_seed(head_seed)
        self.head = torch.nn.Linear(1024, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x)))


def resident_bytes(fd: int) -> int:
    """What a shared-memory file really holds (a punched hole holds nothing)."""
    return os.fstat(fd).st_blocks * 512


def loaded(store: TensorStore, model: torch.nn.Module, name: str, share: bool = True) -> Package:
    return store.add(pack(model, name, hashed=share), share=share)


def test_a_fine_tune_holds_only_its_head_and_answers_as_itself() -> None:
    store = TensorStore(enabled=True)
    first, second = FineTune(head_seed=1), FineTune(head_seed=2)
    a, b = loaded(store, first, "a"), loaded(store, second, "b")

    assert resident_bytes(a.fd) > 4 * MIB
    assert resident_bytes(b.fd) < 64 * 1024  # its head and its pickle: the backbone is a's
    x = torch.randn(2, 1024)
    torch.testing.assert_close(unpack(b).model(x), second(x))
    torch.testing.assert_close(unpack(a).model(x), first(x))
    assert store.shared_bytes(b) == first.backbone.weight.nbytes + first.backbone.bias.nbytes


def test_a_tensor_that_differs_by_one_element_is_not_shared() -> None:
    store = TensorStore(enabled=True)
    base = FineTune(head_seed=1)
    changed = FineTune(head_seed=1)
    with torch.no_grad():
        changed.backbone.weight[1000, 1000] += 1.0
    loaded(store, base, "base")
    package = loaded(store, changed, "changed")

    weight = unpack(package).model.backbone.weight
    assert weight[1000, 1000] == changed.backbone.weight[1000, 1000]
    assert resident_bytes(package.fd) > 4 * MIB  # its own weight (the bias, equal, is base's)


def test_a_digest_that_lies_shares_nothing() -> None:
    """A crafted collision: equal digests, different bytes. The bytes are compared, so each keeps its own."""
    store = TensorStore(enabled=True)
    first = loaded(store, FineTune(head_seed=1), "first")
    other = FineTune(head_seed=1)
    with torch.no_grad():
        other.backbone.weight.mul_(2)
    forged = pack(other, "forged")
    forged = replace(
        forged, blobs=tuple(replace(blob, digest=first.blobs[i].digest) for i, blob in enumerate(forged.blobs))
    )
    package = store.add(forged)

    torch.testing.assert_close(unpack(package).model.backbone.weight, other.backbone.weight)
    really_equal = (other.backbone.bias, other.head.weight)  # (the head's bias, 12 bytes, is never shared)
    assert store.shared_bytes(package) == sum(tensor.nbytes for tensor in really_equal)


def test_unload_in_either_order_keeps_what_the_other_uses_and_frees_the_rest() -> None:
    for order in ("owner first", "borrower first"):
        store = TensorStore(enabled=True)
        owner_model, borrower_model = FineTune(head_seed=1), FineTune(head_seed=2)
        owner, borrower = loaded(store, owner_model, "owner"), loaded(store, borrower_model, "borrower")
        first, second = (owner, borrower) if order == "owner first" else (borrower, owner)
        kept_model = borrower_model if order == "owner first" else owner_model

        store.release(first)
        x = torch.randn(2, 1024)
        torch.testing.assert_close(unpack(second).model(x), kept_model(x))
        if order == "owner first":  # the owner's file lives on for the backbone alone: its head and pickle are gone
            assert 4 * MIB <= resident_bytes(owner.fd) < 4 * MIB + 64 * 1024

        store.release(second)
        assert not store.segments and not store.uses and not store.index


def test_two_equal_tensors_of_one_model_stay_two() -> None:
    """Zero-initialised biases are equal: merged, a write to one would change the other."""
    store = TensorStore(enabled=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2048), torch.nn.Linear(2048, 2048))
    with torch.no_grad():
        model[0].bias.zero_()
        model[1].bias.zero_()
    restored = unpack(loaded(store, model, "zeros")).model
    with torch.no_grad():
        restored[0].bias.fill_(1.0)
    assert restored[1].bias.abs().sum() == 0


@pytest.mark.parametrize(("container", "model"), [(False, True), (True, False)])
def test_sharing_is_off_for_the_container_or_for_one_model(container: bool, model: bool) -> None:
    store = TensorStore(enabled=container)
    loaded(store, FineTune(head_seed=1), "a")
    package = loaded(store, FineTune(head_seed=2), "b", share=model)
    assert store.shared_bytes(package) == 0
    assert resident_bytes(package.fd) > 4 * MIB


def test_a_write_stays_in_the_model_that_made_it() -> None:
    """Copy-on-write on the CPU: each unpack maps the files anew, privately."""
    store = TensorStore(enabled=True)
    loaded(store, FineTune(head_seed=1), "a")
    b = loaded(store, FineTune(head_seed=2), "b")
    writer, reader = unpack(b).model, unpack(b).model
    before = reader.backbone.weight.clone()
    with torch.no_grad():
        writer.backbone.weight.fill_(3.0)
    torch.testing.assert_close(reader.backbone.weight, before)

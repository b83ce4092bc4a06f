"""Shared tensors on a device host's device, run on the CPU through the same code a GPU host runs (the device copy is
a real copy there too): one storage for every model, a write in place undone and refused, freed with the last model."""

from __future__ import annotations

import pytest
import torch

from mme_runtime.models.model_package import Package, pack, unpack
from mme_runtime.models.tensor_store import DeviceTensors, SharedWeightWritten, TensorStore, module_of


def fine_tune(head_seed: int) -> torch.nn.Module:
    torch.manual_seed(0)
    backbone = torch.nn.Linear(512, 512)
    torch.manual_seed(head_seed)
    return torch.nn.Sequential(backbone, torch.nn.ReLU(), torch.nn.Linear(512, 2))


@pytest.fixture
def packages() -> tuple[Package, Package]:
    store = TensorStore(enabled=True)
    return store.add(pack(fine_tune(1), "a")), store.add(pack(fine_tune(2), "b"))


def placed(tensors: DeviceTensors, package: Package, name: str) -> tuple[torch.nn.Module, int]:
    unpacked = unpack(package)
    borrowed = tensors.place(unpacked.model, unpacked.locations, name)
    return unpacked.model, borrowed


def test_two_models_use_one_storage_for_their_shared_tensors(packages: tuple[Package, Package]) -> None:
    tensors = DeviceTensors(torch.device("cpu"))
    places = [((packages[1].segment_ids[blob.segment], blob.offset), blob.nbytes) for blob in packages[1].blobs]
    a, borrowed_a = placed(tensors, packages[0], "a")
    backbone_bytes = 512 * 512 * 4 + 512 * 4
    assert tensors.new_bytes(places) == 512 * 2 * 4 + 2 * 4  # b's head only
    b, borrowed_b = placed(tensors, packages[1], "b")

    assert (borrowed_a, borrowed_b) == (0, backbone_bytes)
    assert a[0].weight.data_ptr() == b[0].weight.data_ptr()
    assert a[2].weight.data_ptr() != b[2].weight.data_ptr()
    x = torch.randn(3, 512)
    torch.testing.assert_close(b(x), fine_tune(2)(x))
    torch.testing.assert_close(a(x), fine_tune(1)(x))


def test_a_write_to_a_shared_tensor_is_undone_and_fails_that_model(packages: tuple[Package, Package]) -> None:
    tensors = DeviceTensors(torch.device("cpu"))
    a, _ = placed(tensors, packages[0], "a")
    b, _ = placed(tensors, packages[1], "b")
    x = torch.randn(3, 512)
    expected = b(x)

    with torch.no_grad():
        a[0].weight.mul_(0.0)  # what a careless predict_fn might do
    with pytest.raises(SharedWeightWritten, match="model a wrote in place to 1 weight tensor") as raised:
        tensors.check_writes("a")
    assert raised.value.status == 500
    torch.testing.assert_close(b(x), expected)
    tensors.check_writes("a")  # put back: the next pass is fine
    tensors.check_writes("b")


def test_the_last_model_to_go_frees_the_shared_tensors(packages: tuple[Package, Package]) -> None:
    tensors = DeviceTensors(torch.device("cpu"))
    placed(tensors, packages[0], "a")
    placed(tensors, packages[1], "b")
    tensors.release("a")
    assert len(tensors._held) == 4  # b's: the backbone's weight and bias (a's too before) and its head
    tensors.release("b")
    assert not tensors._held


def test_the_module_of_a_model_is_what_placement_moves() -> None:
    linear = torch.nn.Linear(2, 2)

    class Wrapped:
        model = linear

    assert module_of(linear) is linear and module_of(Wrapped()) is linear and module_of({"a": 1}) is None


def test_a_write_to_a_tensor_no_one_else_uses_is_kept_and_never_lent(packages: tuple[Package, Package]) -> None:
    tensors = DeviceTensors(torch.device("cpu"))
    a, _ = placed(tensors, packages[0], "a")
    with torch.no_grad():
        a[0].weight.add_(1.0)  # a's alone so far: a keeps its change
    tensors.check_writes("a")
    b, borrowed = placed(tensors, packages[1], "b")
    assert borrowed == 512 * 4  # the bias, a's; the weight b gets as it is in host memory, not a's changed copy
    torch.testing.assert_close(b[0].weight, fine_tune(2)[0].weight)
    assert a[0].weight.data_ptr() != b[0].weight.data_ptr()

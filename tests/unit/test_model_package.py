"""A model packed by the loader and unpacked by a device host: same answers, tied weights still tied, the weights
mapped from the shared file rather than copied, and what cannot travel refused with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import xxhash

from mme_runtime.models.model_package import NotPackable, is_torchscript, pack, pack_torchscript_file, unpack


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(16, 16)
        self.decoder = torch.nn.Linear(16, 16)
        self.decoder.weight = self.encoder.weight
        self.register_buffer("steps", torch.arange(3, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.relu(self.encoder(x)))


def _round_trip(model: object) -> object:
    package = pack(model, "test")
    try:
        return unpack(package).model
    finally:
        package.close()  # the mapping outlives the descriptor


def test_a_module_answers_as_before_with_tied_weights_still_tied() -> None:
    torch.manual_seed(0)
    model = Tied().eval()
    x = torch.randn(5, 16)

    restored = _round_trip({"model": model, "labels": ["a", "b"]})

    assert isinstance(restored, dict) and restored["labels"] == ["a", "b"]
    copy = restored["model"]
    torch.testing.assert_close(copy(x), model(x))
    assert copy.decoder.weight is copy.encoder.weight
    assert copy.steps.dtype == torch.int64 and copy.steps.tolist() == [0, 1, 2]


def test_weights_are_mapped_from_the_shared_file_not_copied() -> None:
    package = pack(torch.nn.Linear(256, 256), "mapped")
    restored = unpack(package).model
    mapped = {
        line.split()[0]
        for line in Path(f"/proc/{os.getpid()}/maps").read_text().splitlines()
        if "memfd:mme-model-mapped" in line
    }
    ranges = [tuple(int(bound, 16) for bound in span.split("-")) for span in mapped]
    pointer = restored.weight.data_ptr()
    assert any(start <= pointer < end for start, end in ranges)
    package.close()


def test_writes_stay_in_the_process_that_made_them() -> None:
    package = pack(torch.nn.Linear(4, 4), "private")
    first = unpack(package).model
    with torch.no_grad():
        first.weight.fill_(7.0)
    second = unpack(package).model  # what a replaced host would map
    assert not torch.equal(second.weight, first.weight)
    package.close()


def test_a_torchscript_module_travels_saved_whole() -> None:
    torch.manual_seed(1)
    scripted = torch.jit.trace(Tied().eval(), torch.randn(2, 16))
    x = torch.randn(3, 16)
    restored = _round_trip(scripted)
    assert isinstance(restored, torch.jit.ScriptModule)
    torch.testing.assert_close(restored(x), scripted(x))


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (lambda x: x, "function cannot be pickled"),
        ({"lock": threading.Lock()}, "dict cannot be pickled"),
    ],
    ids=["lambda", "lock"],
)
def test_what_cannot_be_pickled_is_refused_with_the_reason(model: object, reason: str) -> None:
    with pytest.raises(NotPackable, match=reason):
        pack(model, "refused")


def test_a_class_from_a_user_script_unpacks_where_the_script_is_imported_under_the_same_name(tmp_path: Path) -> None:
    """What a device host does: import the model's script under its unique name, then unpack."""
    script = tmp_path / "inference.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch

            class Doubler(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.scale = torch.nn.Parameter(torch.full((3,), 2.0))

                def forward(self, x):
                    return x * self.scale
            """
        )
    )
    program = textwrap.dedent(
        f"""
        import json, os, sys, torch
        from pathlib import Path
        from mme_runtime.models.model_package import Package, pack, unpack
        from mme_runtime.models.user_code import import_script

        module = import_script("m", Path({str(script)!r}))
        if sys.argv[1] == "pack":
            package = pack(module.Doubler(), "m")
            os.set_inheritable(package.fd, True)
            os.execv(sys.executable, [sys.executable, __file__, "unpack", str(package.fd), json.dumps(package.layout)])
        model = unpack(Package.from_layout([int(sys.argv[2])], json.loads(sys.argv[3]))).model
        print(model(torch.ones(3)).tolist())
        """
    )
    runner = tmp_path / "runner.py"
    runner.write_text(program)
    result = subprocess.run([sys.executable, str(runner), "pack"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[2.0, 2.0, 2.0]"


def test_the_file_holds_each_storage_once() -> None:
    big = torch.nn.Linear(512, 512)
    package = pack([big, big, big.weight], "once")
    size = os.fstat(package.fd).st_size
    assert size < 2 * 512 * 512 * 4  # one copy of the weight, not three
    package.close()


def test_each_storage_carries_the_digest_of_its_bytes_small_or_hashed_aside() -> None:
    model = torch.nn.Linear(1024, 512)  # a 2 MiB weight (hashed on another thread) and a 2 KiB bias (at once)
    package = pack(model, "digests")
    with open(f"/proc/self/fd/{package.fd}", "rb") as file:
        contents = file.read()
    digests = {blob.nbytes: blob.digest for blob in package.blobs}
    for blob in package.blobs:
        assert blob.digest == xxhash.xxh3_128_hexdigest(contents[blob.offset : blob.offset + blob.nbytes])
    assert set(digests) == {1024 * 512 * 4, 512 * 4}
    package.close()
    unhashed = pack(model, "plain", hashed=False)
    assert [blob.digest for blob in unhashed.blobs] == ["", ""]
    unhashed.close()


def test_a_torchscript_file_travels_as_it_is_and_a_checkpoint_is_told_apart(tmp_path: Path) -> None:
    torch.manual_seed(2)
    scripted = torch.jit.script(Tied().eval())
    archive, checkpoint = tmp_path / "model.pt", tmp_path / "model.pth"
    scripted.save(str(archive))
    torch.save(Tied(), checkpoint)
    assert is_torchscript(archive) and not is_torchscript(checkpoint) and not is_torchscript(tmp_path / "missing")

    package = pack_torchscript_file(archive, "file")
    restored = unpack(package).model
    package.close()
    x = torch.randn(2, 16)
    torch.testing.assert_close(restored(x), scripted(x))

"""A load reads an unsealed checkpoint an item at a time, and the ranks of a host share its
verification: each data file is hashed by one of them, and a file that fails is an error on
every rank before anything is changed."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest
import torch

import ringtrain.checkpoint as ckpt
from ringtrain.checkpoint import manifest
from ringtrain.errors import CheckpointError
from ringtrain.testing import spawn


def _trained(seed: int, width: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(6)))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, width)).sum().backward()
    opt.step()
    return model, opt


def test_a_load_holds_no_whole_data_file(tmp_path: Path) -> None:
    # Six 1 MiB weights and Adam's two states of each: one data file of about 19 MiB.
    model, opt = _trained(1, width=512)
    path = ckpt.save(tmp_path / "step-1", model=model, optimizer=opt, step=1)
    data = Path(path, "__0_0.distcp").stat().st_size
    assert data > 18 << 20
    fresh, fresh_opt = _trained(2, width=512)
    tracemalloc.start()
    try:
        ckpt.load(path, model=fresh, optimizer=fresh_opt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Python's bytes in flight: a few items of 1 MiB, never the file (before: all of it).
    assert peak < data // 4, (peak, data)
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())
    )


def _save_two(path: str) -> None:
    import ringtrain as rt

    model, opt = _trained(rt.rank() + 1)
    ckpt.save(path, model=model, optimizer=opt, step=5)


def _load_counting(path: str) -> tuple[list[str], str | None, bool]:
    """Load into fresh objects; which files this rank hashed, its error, whether its model
    was left as it was."""
    hashed: list[str] = []
    real = manifest.sha256_file

    def counting(p: str) -> tuple[str, int]:
        hashed.append(os.path.basename(p))
        return real(p)

    manifest.sha256_file = counting  # type: ignore[assignment]
    model, opt = _trained(99)
    before = [t.clone() for t in model.state_dict().values()]
    try:
        ckpt.load(path, model=model, optimizer=opt)
        error = None
    except CheckpointError as e:
        error = str(e)
    finally:
        manifest.sha256_file = real  # type: ignore[assignment]
    untouched = all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
    return hashed, error, untouched


def test_the_ranks_of_a_host_hash_each_file_once(tmp_path: Path, world2: spawn.World) -> None:
    path = str(tmp_path / "step-5")
    world2.run(_save_two, path)
    files = ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(n for n in os.listdir(path) if n.endswith(".distcp")) == files
    (h0, e0, _), (h1, e1, _) = world2.run(_load_counting, path)
    assert (e0, e1) == (None, None)
    assert (h0, h1) == ([files[0]], [files[1]])
    # A flipped byte in the file rank 1 hashes: both ranks fail, and neither changed anything.
    f = Path(path, files[1])
    blob = bytearray(f.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    f.write_bytes(bytes(blob))
    (_, e0, kept0), (_, e1, kept1) = world2.run(_load_counting, path)
    assert e1 is not None and files[1] in e1 and "SHA-256" in e1
    assert e0 is not None and "failed on rank 1" in e0 and files[1] in e0
    assert kept0 and kept1


def test_a_file_changed_after_it_was_verified_is_an_error_naming_it(tmp_path: Path) -> None:
    # Files are read an item at a time after they were verified: one cut short or overwritten
    # in between is a CheckpointError naming it, not torch's own error or a short tensor.
    from ringtrain.checkpoint import store

    model, opt = _trained(1, width=64)
    path = ckpt.save(tmp_path / "step-1", model=model, optimizer=opt, step=1)
    data = Path(path, "__0_0.distcp")
    for spoil in ("cut", "overwrite"):
        opened = store.open_checkpoint(path, None)
        read = store.reader(opened)
        index = next(iter(opened.metadata.storage_data))
        blob = data.read_bytes()
        info = opened.metadata.storage_data[index]
        spoilt = blob[: info.offset + 8] if spoil == "cut" else b"\0" * len(blob)
        data.write_bytes(spoilt)
        try:
            with pytest.raises(CheckpointError, match="changed while it was loaded") as err:
                read(index)
            assert str(data) in str(err.value)
        finally:
            data.write_bytes(blob)

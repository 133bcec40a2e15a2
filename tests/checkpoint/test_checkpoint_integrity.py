"""A checkpoint is whole or it is an error naming the file: truncated, a flipped byte, a missing
shard, a manifest of another checkpoint, a torn save. Nothing is half-loaded; earlier
checkpoints stay; keep-last-K; torch's own tools read the files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ringtrain.checkpoint as ckpt
from ringtrain.checkpoint import layout, manifest
from ringtrain.errors import CheckpointError
from ringtrain.testing import spawn


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 5)).sum().backward()
    opt.step()
    return model, opt


def _save(root: Path, step: int, seed: int, keep: int = 0) -> str:
    model, opt = _trained(seed)
    return ckpt.save(root / f"step-{step}", model=model, optimizer=opt, step=step, keep=keep)


def _load_fresh(path: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, ckpt.Restored]:
    model, opt = _trained(99)
    restored = ckpt.load(path, model=model, optimizer=opt)
    return model, opt, restored


def _same_model(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_round_trip_and_torch_tools_read_it(tmp_path: Path) -> None:
    model, opt = _trained(1)
    path = ckpt.save(tmp_path / "step-1", model=model, optimizer=opt, step=1, extra={"k": [1]})
    loaded, loaded_opt, restored = _load_fresh(tmp_path)
    assert restored.step == 1 and restored.extra == {"k": [1]}
    assert _same_model(model, loaded)
    want, got = opt.state_dict(), loaded_opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(v, got["state"][i][k])
    # torch.distributed.checkpoint reads the same files (its FileSystemReader and metadata).
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    for k, v in model.state_dict().items():
        assert torch.equal(whole["model"][k], v)
    assert torch.equal(whole["optim"]["0.exp_avg"], want["state"][0]["exp_avg"].reshape(-1))
    man = json.loads((Path(path) / "manifest.json").read_text())
    assert man["world_size"] == 1 and man["step"] == 1 and not man["sealed"]
    assert set(man["files"]) == {".metadata", "__0_0.distcp"}


def _expect_named_error(path: str, name: str, match: str) -> None:
    model, opt = _trained(99)
    before = [t.clone() for t in model.state_dict().values()]
    with pytest.raises(CheckpointError, match=match) as err:
        ckpt.load(path, model=model, optimizer=opt)
    assert os.path.join(path, name) in str(err.value)
    # Nothing half-loaded.
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))


def test_truncated_file(tmp_path: Path) -> None:
    path = _save(tmp_path, 1, 1)
    data = Path(path, "__0_0.distcp").read_bytes()
    Path(path, "__0_0.distcp").write_bytes(data[: len(data) // 2])
    _expect_named_error(path, "__0_0.distcp", "truncated")


def test_flipped_byte(tmp_path: Path) -> None:
    path = _save(tmp_path, 1, 1)
    f = Path(path, "__0_0.distcp")
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    _expect_named_error(path, "__0_0.distcp", "SHA-256")


def test_flipped_byte_in_metadata(tmp_path: Path) -> None:
    path = _save(tmp_path, 1, 1)
    f = Path(path, ".metadata")
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40
    f.write_bytes(bytes(data))
    _expect_named_error(path, ".metadata", "SHA-256")


def test_manifest_of_another_checkpoint(tmp_path: Path) -> None:
    a = _save(tmp_path / "a", 1, 1)
    b = _save(tmp_path / "b", 1, 2)
    shutil.copy(Path(b, "manifest.json"), Path(a, "manifest.json"))
    _expect_named_error(a, ".metadata", "another checkpoint or job")


def test_manifest_that_is_not_an_object(tmp_path: Path) -> None:
    path = _save(tmp_path, 1, 1)
    Path(path, "manifest.json").write_text("[1, 2]")
    _expect_named_error(path, "manifest.json", "holds a JSON list, not an object")


def _save_two(path: str) -> None:
    import ringtrain as rt

    model, opt = _trained(rt.rank() + 1)  # different weights: the deal spreads them
    ckpt.save(path, model=model, optimizer=opt, step=5)


def test_missing_shard(tmp_path: Path, world2: spawn.World) -> None:
    path = str(tmp_path / "step-5")
    world2.run(_save_two, path)
    assert sorted(os.listdir(path)) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "manifest.json",
    ]
    os.remove(os.path.join(path, "__1_0.distcp"))
    _expect_named_error(path, "__1_0.distcp", "missing")


def test_torn_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    first = _save(tmp_path, 1, 1)
    # A save that died before its commit: files written, no manifest, never renamed.
    torn = tmp_path / ".step-2.partial-deadbeef"
    torn.mkdir()
    (torn / layout.data_file(0)).write_bytes(b"half")
    model, _, restored = _load_fresh(tmp_path)
    assert restored.directory == first and restored.step == 1
    # A directory without a manifest is not a checkpoint, and says so.
    os.remove(os.path.join(first, "manifest.json"))
    with pytest.raises(CheckpointError, match=r"manifest\.json missing"):
        ckpt.load(first, model=model)
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        ckpt.load(tmp_path, model=model)


def test_a_file_given_for_a_checkpoint_names_the_directory_to_give(tmp_path: Path) -> None:
    path = _save(tmp_path, 1, 1)
    model, _, _ = _load_fresh(tmp_path)
    given = os.path.join(path, "manifest.json")
    with pytest.raises(CheckpointError) as e:
        ckpt.load(given, model=model)
    assert str(e.value) == (
        f"{given} is a file, not a checkpoint: a checkpoint is the directory a save wrote.\n"
        f"HINT: give {path} if this file is in one, or the directory above the step-N ones for "
        "the newest."
    )


def test_keep_last(tmp_path: Path) -> None:
    for step in range(1, 6):
        _save(tmp_path, step, step, keep=2)
    assert [s for s, _ in manifest.committed(str(tmp_path))] == [4, 5]
    assert not [n for n in os.listdir(tmp_path) if "partial" in n]
    _, _, restored = _load_fresh(tmp_path)
    assert restored.step == 5


def test_model_mismatch_loads_nothing(tmp_path: Path) -> None:
    path = _save(tmp_path, 1, 1)
    other = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Linear(8, 2))
    before = [t.clone() for t in other.state_dict().values()]
    with pytest.raises(CheckpointError, match="has shape"):
        ckpt.load(path, model=other)
    assert all(torch.equal(a, b) for a, b in zip(before, other.state_dict().values()))

"""What a save may replace, and loads refused before anything changes.

A save replaces the directory at its path whole, so it refuses a path that holds anything but a
checkpoint or nothing: a directory of the user's files, the current directory (``save("")``), a
root of ``step-N`` checkpoints, a file. A load refuses a model whose entries differ from the
checkpoint's (torch's ``load_state_dict`` would copy the matching ones first, then raise) and an
optimizer of another class (its state would load, and the first step fail on a missing key).
In one process: the checks are each rank's own, before any collective of the save or the load.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ringtrain.checkpoint as ckpt
from ringtrain.checkpoint import manifest
from ringtrain.errors import CheckpointError

pytestmark = pytest.mark.timeout(120)
KEPT = "It was left as it was, and nothing was saved."


def _net(extra: bool = False) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)]
    return torch.nn.Sequential(*layers, *([torch.nn.Linear(2, 2)] if extra else []))


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_save_refuses_to_replace_what_is_not_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _net()
    mine = tmp_path / "mydata"
    mine.mkdir()
    (mine / "results.csv").write_text("precious")
    ckpt.save(tmp_path / "ck" / manifest.step_name(1), model=model, step=1)
    (tmp_path / "afile").write_text("x")
    before = _files(tmp_path)
    monkeypatch.chdir(mine)
    cases = [
        (mine, "a directory of other files, not a checkpoint", "step-000000003"),
        ("", "a directory of other files, not a checkpoint", "step-000000003"),
        (tmp_path / "ck", "a directory of step-N checkpoints", "step-000000003"),
        (tmp_path / "afile", "a file", ""),
    ]
    for path, what, example in cases:
        with pytest.raises(CheckpointError) as err:
            ckpt.save(path, model=model, step=3)
        where = os.path.abspath(path)
        first, hint = str(err.value).splitlines()
        assert first == (
            f"{where} is {what}: a save replaces the directory at its path whole, so it "
            f"would be deleted. {KEPT}"
        )
        assert (os.path.join(where, example) in hint) if example else "new or empty" in hint
    assert _files(tmp_path) == before
    assert not [p for p in tmp_path.rglob("*") if ".partial-" in p.name]

    # What a save may replace: nothing, an empty directory, a checkpoint (of no run).
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "new", tmp_path / "empty", tmp_path / "ck" / manifest.step_name(1)):
        assert ckpt.save(path, model=model, step=4) == str(path)
        assert ckpt.load(path, model=_net()).step == 4


def test_a_load_refuses_a_model_with_other_entries_and_changes_nothing(tmp_path: Path) -> None:
    ckpt.save(tmp_path, model=_net(), step=1)
    for model, said in [
        (_net(extra=True), "the checkpoint lacks 2 entries (3.bias, 3.weight)"),
        (
            torch.nn.Sequential(torch.nn.Linear(4, 8)),
            "the model lacks 2 entries (2.bias, 2.weight)",
        ),
    ]:
        torch.nn.init.zeros_(model[0].weight)
        with pytest.raises(CheckpointError) as err:
            ckpt.load(tmp_path, model=model)
        assert str(err.value) == (
            f"{tmp_path} does not fit the model: {said}. Nothing was loaded.\nHINT: build the "
            "model as it was saved, or load with strict=False to take the entries both have."
        )
        assert not model[0].weight.any()  # untouched
    model = _net(extra=True)
    ckpt.load(tmp_path, model=model, strict=False)  # the entries both have
    assert torch.equal(model[0].weight, _net()[0].weight)


def test_a_load_refuses_another_optimizers_state(tmp_path: Path) -> None:
    model = _net()
    adam = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    adam.step()
    ckpt.save(tmp_path, model=model, optimizer=adam, step=1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError) as err:
        ckpt.load(tmp_path, model=model, optimizer=sgd)
    assert str(err.value).splitlines()[0] == (
        f"{tmp_path} holds the state of a torch.optim.adam.Adam, and this optimizer is a "
        "torch.optim.sgd.SGD: its state and hyperparameters would not fit."
    )
    assert sgd.param_groups[0]["momentum"] == 0.9 and not sgd.state
    again = torch.optim.Adam(model.parameters())
    ckpt.load(tmp_path, model=model, optimizer=again)
    assert again.state_dict()["state"][0]["step"] == 1

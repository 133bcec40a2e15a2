"""What keeps a save's blocking part short and its write light: no collective per save, the
part streamed to disk (hashed and sealed on the way), buffers and the writer's mappings reused,
small tensors handed over as raw bytes, a later save's directory never swept early; a rank
that skipped a save is never mixed into another rank's save; the writer process imports no DCP
(only rank 0's, at its first commit)."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ringtrain as rt
import ringtrain.checkpoint as ckpt
from ringtrain.checkpoint import api, layout, manifest, process_writer, sealed, store
from ringtrain.checkpoint.layout import Item
from ringtrain.errors import CheckpointError, SecurityError
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(600)


def _items() -> list[Item]:
    big = torch.arange(800_000, dtype=torch.float32)  # 3.2 MB: several of the sink's chunks
    return [
        Item("model.w", big, tuple(big.shape), (0,)),
        Item("meta.extra", {"step": 7, "t": torch.tensor([1, 2, 3])}),
    ]


def test_streamed_part_is_the_serialized_bytes(tmp_path: Path) -> None:
    data, want = layout.serialize(_items())
    path = str(tmp_path / "p")
    digest, nbytes, entries = layout.write_part_file(path, _items())
    on_disk = Path(path).read_bytes()
    assert on_disk == data and nbytes == len(data) and entries == want
    assert digest == hashlib.sha256(on_disk).hexdigest()


def test_streamed_sealed_part_opens_to_the_serialized_bytes(tmp_path: Path) -> None:
    key = os.urandom(32)
    data, want = layout.serialize(_items())
    path = str(tmp_path / "__0_0.distcp")
    digest, nbytes, entries = layout.write_part_file(
        path, _items(), sealed.Sealer(key, "__0_0.distcp")
    )
    blob = Path(path).read_bytes()
    assert nbytes == len(blob) and digest == hashlib.sha256(blob).hexdigest()
    assert entries == want and data not in blob
    assert sealed.open_sealed(key, "__0_0.distcp", path, blob) == data
    with pytest.raises(SecurityError):
        sealed.open_sealed(key, "__1_0.distcp", path, blob)  # another name: another file


@pytest.mark.parametrize(
    "t",
    [
        torch.tensor(3.0),
        torch.arange(10).reshape(2, 5),
        torch.empty(0, 3),
        torch.randn(4, 4).t(),
        torch.tensor([True, False]),
        torch.randn(3, dtype=torch.bfloat16),
        torch.randn(2, dtype=torch.complex64).conj(),
        torch.get_rng_state(),
    ],
)
def test_handover_keeps_tensors_bitwise(t: torch.Tensor) -> None:
    back = pickle.loads(process_writer._dumps({"a": [t]}))["a"][0]
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    if back.numel() and back.dtype != torch.bool:
        back.add_(1)  # writable: its memory is its own


def test_later_saves_directory_is_kept(tmp_path: Path) -> None:
    """Without a collective per save, other ranks may already write save n+1 while rank 0's
    writer commits save n: committing n sweeps unfinished saves, but never a later one."""
    root = tmp_path
    later = root / ".step-2.partial-tok-2"
    stale = [root / ".step-1.partial-0123abcd", root / ".step-9.partial-old-5"]
    for d in [later, *stale]:
        d.mkdir()
    job = store.Job(
        final=str(root / "step-1"),
        partial=str(root / ".step-1.partial-tok-1"),
        save_id="tok-1",
        rank=0,
        size=1,
        step=1,
        keep=0,
        timeout_s=5.0,
        facts={},
    )
    os.mkdir(job.partial)
    store.place(job)
    assert (root / "step-1").is_dir() and later.is_dir()
    assert not any(d.exists() for d in stale)


def test_buffers_replaced_when_shapes_change(tmp_path: Path) -> None:
    """A tensor whose shape changed gets a new buffer under a new name (the old one removed),
    and the writer, which keeps its mappings between saves, writes the new values."""
    with ckpt.Checkpointer(tmp_path) as saver:
        saver.save(1, model=torch.nn.Linear(64, 64))
        saver.wait()
        assert saver.buffer_dir is not None
        before = set(os.listdir(saver.buffer_dir))
        small = torch.nn.Linear(8, 8)  # same keys, other shapes
        saver.save(2, model=small)
        saver.wait()
        after = set(os.listdir(saver.buffer_dir))
        assert len(after) == len(before) and not (after - {".owner"}) & before
        big = torch.nn.Linear(64, 64)
        saver.save(3, model=big)
        saver.wait()
    fresh = torch.nn.Linear(64, 64)
    assert ckpt.load(tmp_path, model=fresh).step == 3
    assert torch.equal(fresh.weight, big.weight) and torch.equal(fresh.bias, big.bias)


# The tests at two ranks check the save ids and parts, which both writers handle alike (the
# same store.write_part and store.commit); the thread spares each rank a writer process that
# imports torch. The process writer at two ranks: test_checkpoint_async.py.
_RANKS_WRITER = "thread"


def _saves_without_collectives(root: str) -> tuple[int, list[str]]:
    calls = []
    agree = api.new_token  # the one collective of a Checkpointer's saves: its id and root

    def counting(path: str) -> str:
        calls.append(path)
        return agree(path)

    api.new_token = counting  # type: ignore[assignment]
    try:
        model = torch.nn.Linear(16, 16)
        with ckpt.Checkpointer(root, keep=0, writer=_RANKS_WRITER) as saver:
            for step in range(1, 4):
                saver.save(step, model=model)
                saver.wait()
    finally:
        api.new_token = agree  # type: ignore[assignment]
    return len(calls), [step for step, _ in manifest.committed(root)]


def test_one_agreement_per_world_not_per_save(tmp_path: Path, world2: spawn.World) -> None:
    got = world2.run(_saves_without_collectives, str(tmp_path))
    assert [n for n, _ in got] == [1, 1]  # the first save agrees on a prefix; then none
    assert got[0][1] == [1, 2, 3]


def _rank_0_skips_a_save(root: str) -> str:
    """Rank 0 skips step 2, so its save of step 3 has rank 1's step-2 id (the first save's:
    no save needs the other rank's part in time). Returns what rank 0's ``wait()`` raised."""
    model = torch.nn.Linear(16, 16)
    with ckpt.Checkpointer(root, keep=0, writer=_RANKS_WRITER) as saver:
        for step in (2, 3) if rt.rank() == 1 else (3,):
            saver.save(step, model=model)
        try:
            saver.wait()
        except CheckpointError as e:
            return str(e)
    return ""


def test_a_rank_that_skipped_a_save_is_never_mixed_in(tmp_path: Path, world2: spawn.World) -> None:
    # timeout_s: how long rank 0's writer waits for the other ranks' parts.
    said = world2.run(_rank_0_skips_a_save, str(tmp_path), timeout_s=10)
    # Rank 1 wrote its parts, then waited for a commit that never came.
    assert "rank 0 did not commit the save into" in said[1] and "within 10 s" in said[1], said
    assert "step-000000003 failed" in said[0] and "ranks [1] wrote no part" in said[0], said
    assert manifest.committed(str(tmp_path)) == []
    # Rank 1's part of step 3 was written, under its own id, beside the one rank 0 waited in.
    waited = said[0].split("wrote no part into ")[1].split(" within")[0]
    (theirs,) = [p for p in tmp_path.glob(".step-000000003.partial-*") if str(p) != waited]
    assert (theirs / layout.part_file(1)).exists()


def test_the_writer_process_starts_without_dcp() -> None:
    # What the writer process imports before its first save: DCP's modules take about a second
    # of CPU, which only rank 0's writer needs (to commit). Rank 0's imports them before it
    # lowers its priority: later, at niceness +19 on a busy host, that second took minutes (a
    # suite run beside stress-ng).
    for flags, dcp in (([], False), (["commits"], True)):
        probe = (
            "import sys; from ringtrain.checkpoint.process_writer import preload; "
            f"preload({flags!r}); print('torch.distributed.checkpoint' in sys.modules)"
        )
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(dcp), flags

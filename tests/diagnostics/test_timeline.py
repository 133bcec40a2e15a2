"""The timeline: valid Chrome traces, one per rank, showing buckets overlap backward."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.diagnostics import timeline
from ringtrain.errors import NotInitializedError
from ringtrain.testing.spawn import World

BUCKET_EVENTS = {"FILL", "PACK", "ALLREDUCE", "UNPACK"}


def test_off_by_default_and_the_null_recorder_does_nothing() -> None:
    rec = timeline.current()
    assert rec.enabled is False and rec is timeline.NULL
    rec.span("x", "Y", 0.0, 1.0)  # no file, no error


def test_recorder_writes_a_valid_trace_with_named_lanes(tmp_path: Any) -> None:
    path = str(tmp_path / "t.json")
    rec = timeline.start(path, pid=3)
    try:
        assert timeline.current() is rec
        t = 100.0
        rec.span("bucket 00", "ALLREDUCE", t, t + 0.002, {"bytes": 8})
        rec.instant("step", "MARK", t)
    finally:
        timeline.stop()
    assert timeline.current() is timeline.NULL
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    span = next(e for e in events if e["name"] == "ALLREDUCE")
    assert span["ph"] == "X" and span["pid"] == 3 and span["dur"] == 2000.0
    lanes = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert lanes["bucket 00"] == span["tid"] and "step" in lanes


def test_rank_paths_merge_and_unterminated_files(tmp_path: Any) -> None:
    assert timeline.rank_path("out/t.json", 2) == "out/t.rank2.json"
    assert timeline.rank_path("trace", 0) == "trace.rank0.json"
    # A blank name or a directory made hidden .rank0.json files, or files beside the directory.
    for bad, what in (("", "a blank one"), (" ", "a blank one"), (str(tmp_path), "a directory")):
        with pytest.raises(rt.ConfigError, match=f"give a file name, not {what}"):
            timeline.rank_path(bad, 0)
    with pytest.raises(NotInitializedError):  # Horovod's ValueError before init()
        rt.stop_timeline()
    paths = []
    for rank in range(2):
        p = str(tmp_path / f"t.rank{rank}.json")
        rec = timeline.Recorder(p, pid=rank)
        rec.span("compute", "BACKWARD", 1.0, 2.0)
        rec.close()
        paths.append(p)
    crashed = str(tmp_path / "crashed.json")
    rec = timeline.Recorder(crashed, pid=5)
    rec.span("compute", "BACKWARD", 1.0, 2.0)
    rec._flush_locked()  # written but never closed, as if the process died
    assert any(e["name"] == "BACKWARD" for e in timeline.load(crashed))
    out = str(tmp_path / "merged.json")
    assert timeline.main([out, *paths]) == 0
    merged = timeline.load(out)
    assert {e["pid"] for e in merged if e["name"] == "BACKWARD"} == {0, 1}


def _traced_training(base: str) -> str:
    # Horovod's start_timeline returns None (horovod/common/basics.py); the file is this rank's.
    # mark_cycles is accepted (docs/diagnostics.md: ringtrain has no cycles to mark).
    assert rt.start_timeline(base, mark_cycles=True) is None
    path = timeline.rank_path(base, rt.rank())
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 4))
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        fusion_threshold_bytes=300 * 1024,  # about one layer per bucket
    )
    g = torch.Generator().manual_seed(rt.rank())
    for _ in range(4):
        x = torch.randn(128, 256, generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), torch.zeros(128, dtype=torch.long)).backward()
        opt.step()
    rt.allreduce(torch.ones(3), name="timeline.probe")
    rt.stop_timeline()
    return path


def test_training_timeline_per_rank_shows_buckets_overlapping_backward(
    world: World, tmp_path: Any
) -> None:
    paths = world.run(_traced_training, str(tmp_path / "trace.json"))
    for rank, path in enumerate(paths):
        assert path == str(tmp_path / f"trace.rank{rank}.json")
        with open(path) as f:
            events = json.load(f)["traceEvents"]  # valid JSON, closed
        assert {e["pid"] for e in events} == {rank}
        names = {e["name"] for e in events}
        assert "OPTIMIZER_STEP" in names
        if world.size == 1:
            continue  # no hooks and nothing exchanged at world size 1
        assert BUCKET_EVENTS | {"BACKWARD", "PLAN", "SYNCHRONIZE", "NEGOTIATE"} <= names
        lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        sends = [
            e for e in events if e["name"] == "ALLREDUCE" and lanes[e["tid"]].startswith("bucket")
        ]
        backward = [e for e in events if e["name"] == "BACKWARD"]
        assert len(backward) == 4 and len({lanes[e["tid"]] for e in sends}) >= 3
        # After the learning step, some bucket is sent while backward is still running.
        overlapped = [
            s for b in backward[1:] for s in sends if b["ts"] <= s["ts"] < b["ts"] + b["dur"]
        ]
        assert overlapped, "no bucket allreduce started before backward ended"
        negotiated = [e for e in events if lanes.get(e["tid"], "").startswith("collectives")]
        assert any("timeline.probe" in e.get("args", {}).get("tensors", []) for e in negotiated)


def _configured_timeline() -> bool:
    model = torch.nn.Linear(4, 2)
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return timeline.current().enabled


def test_timeline_filename_setting_starts_it_at_init(world2: World, tmp_path: Any) -> None:
    base = str(tmp_path / "cfg.json")
    assert world2.run(_configured_timeline, env={"RINGTRAIN_TIMELINE_FILENAME": base}) == [
        True,
        True,
    ]
    for rank in range(2):
        path = timeline.rank_path(base, rank)
        assert os.path.exists(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]  # closed by shutdown
        assert any(e["name"] == "ALLREDUCE" for e in events)


def test_the_merge_never_overwrites_a_rank_s_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Forgetting OUT (`timeline t.rank0.json t.rank1.json`) used to overwrite rank 0's file.
    paths = []
    for rank in range(2):
        paths.append(str(tmp_path / f"t.rank{rank}.json"))
        rec = timeline.Recorder(paths[-1], pid=rank)
        rec.span("compute", "BACKWARD", 1.0, 2.0)
        rec.close()
    before = [Path(p).read_bytes() for p in paths]
    for argv in (paths, [paths[1], *paths]):
        with pytest.raises(SystemExit) as refused:
            timeline.main(argv)
        assert refused.value.code == 2
    said = capsys.readouterr().err
    assert f"OUT {paths[0]} is a rank's own timeline" in said
    assert f"OUT {paths[1]} is also one of the files to merge" in said
    assert [Path(p).read_bytes() for p in paths] == before
    # A file that is no timeline, or none at all: named, and nothing written.
    (tmp_path / "notes.txt").write_text("not json")
    out = tmp_path / "merged.json"
    for bad in ("notes.txt", "missing.json"):
        assert timeline.main([str(out), paths[0], str(tmp_path / bad)]) == 1
        assert bad in capsys.readouterr().err and not out.exists()


def test_the_merge_refuses_files_of_two_jobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # trace.rank0.json of today's run beside yesterday's trace.rank1.json used to merge into
    # one job's trace without a word: each file now records its job, and mixed jobs are refused.
    def write(name: str, rank: int, job: str | None) -> str:
        rec = timeline.Recorder(str(tmp_path / name), pid=rank, job=job)
        rec.span("compute", "BACKWARD", 1.0, 2.0)
        rec.close()
        return str(tmp_path / name)

    today = [write(f"t.rank{r}.json", r, "job-b") for r in range(2)]
    old = write("old.rank1.json", 1, "job-a")
    crashed = timeline.Recorder(str(tmp_path / "crashed.rank1.json"), pid=1, job="job-a")
    crashed.span("compute", "BACKWARD", 1.0, 2.0)
    crashed._flush_locked()  # unterminated: its job is still read
    out = tmp_path / "merged.json"
    for other in (old, crashed.path):
        assert timeline.main([str(out), today[0], other]) == 1
        said = capsys.readouterr().err
        assert f"the files come from 2 different jobs (job job-b: {today[0]}; job job-a: " in said
        assert "Merge the files of one job at a time" in said and not out.exists()
    assert timeline.main([str(out), *today]) == 0  # one job: merged, and it says which
    assert json.loads(out.read_text())["otherData"] == {"job": "job-b"}
    # A file that names no job (an older one, a launcher that tells none) is not refused
    assert timeline.main([str(tmp_path / "m2.json"), today[0], write("x.rank1.json", 1, None)]) == 0


def test_the_job_a_timeline_records_is_the_launchers() -> None:
    from ringtrain.runtime.environment import job_id

    assert job_id({"RINGTRAIN_JOB_ID": "4dc0bb23c225", "SLURM_JOB_ID": "7"}) == "4dc0bb23c225"
    assert job_id({"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's default, every run
    assert job_id({"TORCHELASTIC_RUN_ID": "a1"}) == "torchrun a1"
    assert job_id({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2"}) == "slurm 7.2"
    assert job_id({"OMPI_MCA_ess_base_jobid": "123"}) == "mpirun 123"


def test_a_killed_rank_s_events_reach_the_file_and_an_empty_file_is_named(
    tmp_path: Any, monkeypatch: Any, capsys: Any
) -> None:
    # Events are written a second after the last write at the latest, not only every
    # FLUSH_EVERY events: a rank SIGKILLed mid-training had left an empty file.
    monkeypatch.setattr(timeline, "FLUSH_AFTER_S", 0.0)
    alive = str(tmp_path / "t.rank0.json")
    rec = timeline.Recorder(alive, pid=0)
    rec.span("compute", "BACKWARD", 1.0, 2.0)  # never closed, as if the process were killed
    assert any(e["name"] == "BACKWARD" for e in timeline.load(alive))
    killed = tmp_path / "t.rank1.json"
    killed.write_text("")  # killed before its first write
    out = str(tmp_path / "merged.json")
    assert timeline.main([out, alive, str(killed)]) == 0
    err = capsys.readouterr().err
    assert f"{killed} held no events" in err and alive not in err


def test_a_rank_that_goes_quiet_has_its_events_in_the_file_a_second_later(tmp_path: Any) -> None:
    # A rank that stops making events (stuck, or waiting for a peer) wrote nothing more: what it
    # held stayed in memory, and a rank the launcher then stopped (SIGTERM after a peer failed)
    # left a file without its last steps. A timer writes them within FLUSH_AFTER_S.
    path = str(tmp_path / "t.rank0.json")
    rec = timeline.Recorder(path, pid=0)
    try:
        rec.span("compute", "BACKWARD", 1.0, 2.0)  # the first write: the header and this
        rec.span("step", "SYNCHRONIZE", 2.0, 3.0)  # within the second: held in memory
        deadline = time.monotonic() + timeline.FLUSH_AFTER_S + 2.0
        while time.monotonic() < deadline and not any(
            e["name"] == "SYNCHRONIZE" for e in timeline.load(path)
        ):
            time.sleep(0.05)
        assert any(e["name"] == "SYNCHRONIZE" for e in timeline.load(path))
    finally:
        rec.close()
    assert [e["name"] for e in timeline.load(path) if e["ph"] == "X"] == [
        "BACKWARD",
        "SYNCHRONIZE",
    ]

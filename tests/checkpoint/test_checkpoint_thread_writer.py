"""The thread writer (``Checkpointer(writer="thread")``, ``checkpoint_writer``): saves from
private host buffers on a thread of this process, with the writer process's semantics (one save
in flight, failures raised at check()/wait() with a HINT); ``auto`` picks it on the TCP
transport. The real enclave job is tests/security/test_enclave_checkpoint.py."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import ringtrain.checkpoint as ckpt
from ringtrain.checkpoint import manifest, store
from ringtrain.config import Config
from ringtrain.errors import CheckpointError, ConfigError
from ringtrain.transport import tcp_backend

pytestmark = pytest.mark.timeout(120)


def _model() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))


def test_thread_writer_saves_what_load_gives_back(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    snapshot: list[torch.Tensor] = []
    extra = {"step": 0}
    # This process's children so far (under xdist a worker may hold some: Spark's JVM, a
    # forkserver): the saves must add none.
    before = {p.pid for p in psutil.Process().children()}
    with ckpt.Checkpointer(tmp_path, keep=2, writer="thread") as saver:
        for step in range(1, 4):
            model(torch.ones(2, 32)).sum().backward()
            opt.step()
            extra["step"] = step
            saver.save(step, model=model, optimizer=opt, extra=extra)
            snapshot = [p.detach().clone() for p in model.parameters()]
            extra["step"] = -1  # the save took its own copy
            with torch.no_grad():  # training goes on while the write runs
                for p in model.parameters():
                    p.add_(1.0)
        assert saver.writer_kind == "thread" and saver.writer_pid is None
        assert saver.buffer_dir is None  # no shared memory
        assert {p.pid for p in psutil.Process().children()} <= before  # no writer process
        buffers = dict(saver._writer._buffers)  # type: ignore[union-attr]
        saver.save(4, model=model, optimizer=opt)
        assert all(saver._writer._buffers[k] is b for k, b in buffers.items())  # type: ignore[union-attr]
        saver.wait()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(1.0)  # back to step 3's weights
    assert [s for s, _ in manifest.committed(str(tmp_path))] == [3, 4]
    fresh = _model()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    restored = ckpt.load(tmp_path / manifest.step_name(3), model=fresh, optimizer=fresh_opt)
    assert restored.step == 3 and restored.extra == {"step": 3}
    assert all(torch.equal(a, b) for a, b in zip(snapshot, fresh.parameters()))
    assert fresh_opt.state_dict()["state"][0]["step"] == 3


def test_thread_writer_failure_is_raised_with_the_hint(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    model = _model()
    with ckpt.Checkpointer(blocker / "ck", writer="thread") as saver:
        saver.save(1, model=model)  # returns: the write fails on the thread
        saver._writer._thread.join()  # type: ignore[union-attr]
        with pytest.raises(CheckpointError, match=r"step-000000001 failed: .*\nHINT: "):
            saver.check()
        saver.check()  # raised once
        saver.save(2, model=model)
        with pytest.raises(CheckpointError, match=r"step-000000002 failed: .*\nHINT: "):
            saver.wait()


def test_thread_writer_keeps_one_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each save's part is written once its step's event is set: save 2 is held too, or it
    # could be committed before the check that only save 1 is.
    release = {1: threading.Event(), 2: threading.Event()}
    write_part = store.write_part

    def held(job: store.Job, items: Any, keys: Any) -> Any:
        assert release[job.step].wait(60)
        return write_part(job, items, keys)

    monkeypatch.setattr(store, "write_part", held)
    model = _model()
    with ckpt.Checkpointer(tmp_path, writer="thread") as saver:
        saver.save(1, model=model)
        assert saver.in_flight()
        threading.Timer(0.3, release[1].set).start()
        saver.save(2, model=model)  # waits for save 1, which is committed when this returns
        assert [s for s, _ in manifest.committed(str(tmp_path))] == [1]
        assert saver.last_phases["previous"] > 0
        assert saver.in_flight()
        release[2].set()
        saver.wait()
        assert not saver.in_flight()
    assert [s for s, _ in manifest.committed(str(tmp_path))] == [1, 2]


def test_auto_picks_the_thread_on_the_tcp_transport(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert not tcp_backend.configured()  # not initialized: no TCP mesh
    for configured, kind in ((False, "process"), (True, "thread")):
        if configured:
            tcp_backend.configure("127.0.0.1")  # what ringtrain.init does on --transport tcp
        try:
            with caplog.at_level("INFO", logger="ringtrain"):
                assert ckpt.Checkpointer(tmp_path, writer="auto")._made_writer().kind == kind
        finally:
            tcp_backend.deconfigure()
        assert f"the {kind} writer (auto: " in caplog.text


def test_the_setting_chooses_and_bad_values_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Config().checkpoint_writer == "auto"
    assert Config.from_env({"RINGTRAIN_CHECKPOINT_WRITER": "thread"}).checkpoint_writer == "thread"
    with pytest.raises(
        ConfigError, match=r"checkpoint_writer must be one of auto, process, thread"
    ):
        Config.from_env({"RINGTRAIN_CHECKPOINT_WRITER": "fork"})
    with pytest.raises(ConfigError, match=r"one of auto, process, thread, got 'fork'"):
        ckpt.Checkpointer(tmp_path, writer="fork")
    monkeypatch.setenv("RINGTRAIN_CHECKPOINT_WRITER", "thread")
    assert ckpt.Checkpointer(tmp_path).writer == "thread"
    durable = ckpt.Durable(config=Config(checkpoint_dir=str(tmp_path), checkpoint_writer="thread"))
    assert durable._saver is not None and durable._saver.writer == "thread"


def test_a_preemptions_save_is_written_on_a_thread_beside_the_writer_process(
    tmp_path: Path,
) -> None:
    """``save(urgent=True)`` (a durable job's stop): with the process writer configured, the
    save is written on a thread of this rank, where no writer process runs yet (none is started
    for it) and where one runs (it writes the saves before and after, lends its buffers to the
    thread, and is stopped at close without a wait for its turn: nothing is in flight); each commits what load gives back."""
    model = _model()
    before = {p.pid for p in psutil.Process().children()}
    with ckpt.Checkpointer(tmp_path / "fresh", writer="process") as saver:
        saver.save(1, model=model, urgent=True)
        assert saver._by is saver._spare and saver.writer_pid is None
        saved = {"fresh": [p.detach().clone() for p in model.parameters()]}
        assert {p.pid for p in psutil.Process().children()} <= before
    with ckpt.Checkpointer(tmp_path / "later", writer="process") as saver:
        saver.save(1, model=model)
        saver.wait()
        assert saver._by is saver._writer and saver.writer_kind == "process"
        pid = saver.writer_pid
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        saver.save(2, model=model, urgent=True)
        assert saver._by is saver._spare and saver.writer_pid == pid
        # Its host copy is the writer process's shared buffers: no second copy of the state.
        shared = {b.data_ptr() for _, b in saver._writer._buffers.values()}
        lent = {b.data_ptr() for b in saver._spare._buffers.values()}
        assert lent and lent <= shared
        saver.wait()
        saver.save(3, model=model)  # an elastic rank that goes on: its writer process again
        assert saver._by is saver._writer and saver.writer_pid == pid
        saved["later"] = [p.detach().clone() for p in model.parameters()]
        saver.wait()
        # A writer that gets no turn (stopped here; a niced one on a busy host): close kills it
        # rather than wait the 10 s it gives a writer whose save may be in flight.
        process = saver._writer._proc
        process.send_signal(signal.SIGSTOP)
        closing = time.monotonic()
    assert time.monotonic() - closing < 8.0
    # A killed process can take a while to end on a busy host (q89 saw one still running).
    assert process.wait(timeout=60) == -signal.SIGKILL
    for where, step in (("fresh", 1), ("later", 3)):
        assert [s for s, _ in manifest.committed(str(tmp_path / where))][-1] == step
        fresh = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
        ckpt.load(tmp_path / where / manifest.step_name(step), model=fresh)
        assert all(torch.equal(a, b) for a, b in zip(saved[where], fresh.parameters()))

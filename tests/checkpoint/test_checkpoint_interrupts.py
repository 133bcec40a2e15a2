"""A Ctrl-C or a preemption's SIGTERM that comes while a save changes hands loses nothing: a save
handed to the writer is one that ``wait()`` and ``close()`` wait for, an outcome taken from the
writer is one recorded. The signal is sent at the worst moment, from inside the hand-over (CI
saw it come there by chance: a preempted job's save in flight was never committed). One that
comes while ``save()`` waits for the previous save is raised once the save asked for is handed
over too (CI saw rank 0 leave from that wait: its peers' save of that step could not commit)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import ringtrain.checkpoint as ckpt
from ringtrain.checkpoint import interrupts, manifest, preemption, store
from ringtrain.checkpoint.process_writer import ProcessWriter
from ringtrain.checkpoint.thread_writer import ThreadWriter
from ringtrain.errors import CheckpointError

pytestmark = pytest.mark.timeout(120)
WRITERS = {"process": ProcessWriter, "thread": ThreadWriter}


class Preempted(Exception):
    """What the test's SIGTERM handler raises (a durable job's raises SystemExit)."""


# Each signal as a script meets it: Ctrl-C's KeyboardInterrupt (Python's own handler), and a
# SIGTERM handler that raises (Durable's, which raises SystemExit).
RAISES = {signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: Preempted}


@contextlib.contextmanager
def _raising(sig: signal.Signals) -> Iterator[list[int]]:
    """``sig`` raises as in :data:`RAISES`; yields the signals handled, in order."""
    seen: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)
        if signum == signal.SIGINT:
            signal.default_int_handler(signum, frame)
        raise Preempted(signum)

    before = signal.signal(sig, handler)
    try:
        yield seen
    finally:
        signal.signal(sig, before)


@pytest.fixture
def sigterm_raises() -> Iterator[list[int]]:
    with _raising(signal.SIGTERM) as seen:
        yield seen


def _signalled_inside(method: Any, sig: signal.Signals, when: Any = lambda got: True) -> Any:
    """``method``, which sends this process ``sig`` just before it returns (where ``when`` of
    what it returns), then runs on a few statements (where the handler would run, were it not
    deferred)."""

    def wrapped(self: Any, *args: Any) -> Any:
        got = method(self, *args)
        if when(got):
            os.kill(os.getpid(), sig)
            sum(range(10_000))
        return got

    return wrapped


@pytest.mark.parametrize("sig", RAISES, ids=lambda s: s.name)
@pytest.mark.parametrize("kind", WRITERS)
def test_a_signal_during_the_hand_over_leaves_the_save_waited_for(
    tmp_path: Path, kind: str, sig: signal.Signals, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = WRITERS[kind]
    monkeypatch.setattr(cls, "submit", _signalled_inside(cls.submit, sig))
    with _raising(sig) as seen, ckpt.Checkpointer(tmp_path, writer=kind) as saver:
        with pytest.raises(RAISES[sig]):
            saver.save(1, model=torch.nn.Linear(8, 8))
        assert seen == [sig]  # handled once, after the hand-over
        monkeypatch.undo()
        assert saver.wait() == os.path.join(str(tmp_path), manifest.step_name(1))
    assert [s for s, _ in manifest.committed(str(tmp_path))] == [1]


@pytest.mark.parametrize("sig", RAISES, ids=lambda s: s.name)
@pytest.mark.parametrize("kind", WRITERS)
def test_a_signal_while_the_outcome_is_taken_leaves_it_recorded(
    tmp_path: Path, kind: str, sig: signal.Signals, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = WRITERS[kind]
    with _raising(sig) as seen, ckpt.Checkpointer(tmp_path, writer=kind) as saver:
        saver.save(1, model=torch.nn.Linear(8, 8))
        taken = _signalled_inside(cls.outcome, sig, when=lambda got: got is not None)
        monkeypatch.setattr(cls, "outcome", taken)
        with pytest.raises(RAISES[sig]):
            saver.wait()
        monkeypatch.undo()
        assert seen == [sig]
        assert not saver.in_flight()  # before: the outcome was lost, and a wait never ended
        assert saver.last_committed == os.path.join(str(tmp_path), manifest.step_name(1))


def _signalled_in_the_wait(method: Any, sig: signal.Signals, times: int) -> Any:
    """A writer's ``wait``, which is sent ``sig`` ``times`` times (each handled before the next
    is sent: two sent at once reach Python's handler as one) at its first call."""
    calls: list[int] = []

    def wrapped(self: Any, *args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            for _ in range(times):
                os.kill(os.getpid(), sig)
                sum(range(10_000))
        return method(self, *args)

    return wrapped


@pytest.mark.parametrize("times", [1, 2], ids=["once", "twice"])
@pytest.mark.parametrize("sig", RAISES, ids=lambda s: s.name)
@pytest.mark.parametrize("kind", WRITERS)
def test_a_signal_while_a_save_waits_for_the_previous_one(
    tmp_path: Path, kind: str, sig: signal.Signals, times: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once: handled after this save is handed over, which then commits. Twice (the user
    insists): handled at once, in the wait; this save is never handed over."""
    cls = WRITERS[kind]
    model = torch.nn.Linear(8, 8)
    with _raising(sig) as seen, ckpt.Checkpointer(tmp_path, writer=kind) as saver:
        saver.save(1, model=model)
        monkeypatch.setattr(cls, "wait", _signalled_in_the_wait(cls.wait, sig, times))
        with pytest.raises(RAISES[sig]):
            saver.save(2, model=model)
        monkeypatch.undo()
        assert seen == [sig]  # handled once either way
        newest = 2 if times == 1 else 1
        assert saver.wait() == os.path.join(str(tmp_path), manifest.step_name(newest))
    assert [s for s, _ in manifest.committed(str(tmp_path))] == list(range(1, newest + 1))


def test_a_signal_in_the_wait_does_not_hide_the_previous_saves_failure(
    tmp_path: Path, sigterm_raises: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interruption is raised from ``save()``; the earlier save's failure then from
    ``close()`` (a durable job's ``with`` block), which a ``SystemExit`` would not print."""

    def failing(*_: object) -> None:
        raise store.unwritable(OSError(28, "No space left on device", "part"), "step-1")

    model = torch.nn.Linear(8, 8)
    saver = ckpt.Checkpointer(tmp_path, writer="thread")
    with monkeypatch.context() as patched:
        patched.setattr(store, "write_part", failing)
        saver.save(1, model=model)
        waits = _signalled_in_the_wait(ThreadWriter.wait, signal.SIGTERM, 1)
        patched.setattr(ThreadWriter, "wait", waits)
        with pytest.raises(Preempted):
            saver.save(2, model=model)
    assert sigterm_raises == [signal.SIGTERM]
    with pytest.raises(CheckpointError, match="no space left on device"):
        saver.close()
    assert manifest.committed(str(tmp_path)) == []


_DURABLE_SECTION = """
import os, signal, sys, time
from ringtrain.checkpoint import interrupts, preemption
job = preemption.Preemption(within_s=60.0)
job.install()
try:
    with interrupts.deferred(insist=True):
        for i in range(int(sys.argv[1])):
            if i == 2:  # the third: a second notice, or the first's duplicate (preemption.py)
                time.sleep(float(sys.argv[2]))
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(10_000))
        print("section done", flush=True)
    print("asked to stop:", job.requested, flush=True)
finally:
    print("unwound", flush=True)
"""


@pytest.mark.parametrize("times", ["1", "2", "3-at-once", "3"])
def test_durables_sigterm_in_a_waiting_section(times: str) -> None:
    """Durable's handler, a SIGTERM in a waiting section (``save()``'s): the first only asks the
    job to stop at its next step, after the section; a second, the user insisting, is handled at
    once, as the first (it only asks); a third unwinds (SystemExit(143)) after the section,
    unless it came right after the first (the same notice twice: it only asks)."""
    gap = "0" if times == "3-at-once" else str(preemption.DUPLICATE_S + 0.5)
    ran = subprocess.run(
        [sys.executable, "-c", _DURABLE_SECTION, times[0], gap],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if times != "3":
        want = (0, "section done\nasked to stop: True\nunwound\n")
        assert (ran.returncode, ran.stdout) == want, ran.stderr
    else:
        assert (ran.returncode, ran.stdout) == (143, "section done\nunwound\n"), ran.stderr


def test_the_handlers_are_the_scripts_own_again_after_the_section(
    sigterm_raises: list[int],
) -> None:
    before = {sig: signal.getsignal(sig) for sig in interrupts.SIGNALS}
    with interrupts.deferred():
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]  # noted in here
    assert {sig: signal.getsignal(sig) for sig in interrupts.SIGNALS} == before
    with pytest.raises(Preempted), interrupts.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(10_000))
        done = True
    assert done and sigterm_raises == [signal.SIGTERM]
    with pytest.raises(Preempted) as raised, interrupts.deferred():  # the block's error stays
        os.kill(os.getpid(), signal.SIGTERM)
        raise OSError("the block failed")
    assert isinstance(raised.value.__context__, OSError)


def test_a_signal_left_to_the_system_is_not_touched() -> None:
    """SIGTERM's default ends the process at once, save or not: a rank that did not ask to
    unwind (no ``Durable``) is not kept alive by a section."""
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with interrupts.deferred():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)

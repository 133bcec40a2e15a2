"""The store values that carry a user's words are sealed in secure mode (security/notes.py): a
departure's exception message and the names of waiting collectives, which the plaintext
rendezvous store would otherwise show anyone on the network."""

from __future__ import annotations

import datetime
import sys

import pytest
import torch.distributed as dist

from ringtrain.collectives.crossset import Board, Stuck
from ringtrain.errors import SecurityError
from ringtrain.runtime import departures
from ringtrain.security import keys
from ringtrain.security.notes import PLAIN, Notes


def test_notes_open_only_with_the_key_and_under_their_own_store_key() -> None:
    notes = Notes(keys.generate_job_key())
    sealed = notes.seal("ringtrain/departed/1", b"ValueError: patient 1234")
    assert b"patient" not in sealed
    assert notes.open("ringtrain/departed/1", sealed) == b"ValueError: patient 1234"
    with pytest.raises(SecurityError, match="not sealed with this job's key"):
        notes.open("ringtrain/departed/0", sealed)  # moved to another rank's key
    with pytest.raises(SecurityError):
        Notes(keys.generate_job_key()).open("ringtrain/departed/1", sealed)  # another job
    with pytest.raises(SecurityError):
        notes.open("ringtrain/departed/1", b"ValueError: forged")  # posted in plain
    assert PLAIN.seal("k", b"v") == b"v" and PLAIN.open("k", b"v") == b"v"


def _store() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip


def test_a_departure_s_words_and_waiting_names_are_sealed_in_the_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # bind() installs ringtrain's except hook once per process: keep this process's own.
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(departures, "_previous_hook", None)
    store, notes = _store(), Notes(keys.generate_job_key())
    departures.bind(store, 1, "hostA", notes)
    try:
        departures.post(departures.FAILED, "ValueError: patient 1234")
        raw = bytes(store.get(departures.PREFIX + "1"))
        assert b"patient" not in raw and b"hostA" not in raw
        (found,) = departures.read(store, [1])
        assert (found.rank, found.how, found.why) == (
            1,
            departures.FAILED,
            "ValueError: patient 1234",
        )
    finally:
        departures.unbind()
    board = Board(store, 0, notes)
    board.update(0, [Stuck("patients.embedding", 0, (0, 1), (0,))])
    assert b"patients" not in bytes(store.get("ringtrain/stuck/0"))
    assert Board(store, 1, notes).read(0)[0].name == "patients.embedding"
    assert Board(store, 1).read(0) == ()  # without the key: no evidence, not an error

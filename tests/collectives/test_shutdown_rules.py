"""The shutdown rules of a process set, decided from one round without a process."""

from __future__ import annotations

from ringtrain.collectives.shutdown_rules import Vote, doomed, error, set_ends
from ringtrain.errors import CollectiveAbortedError, PeerFailedError

RUN = Vote()  # a rank still running, nothing in flight
BUSY = Vote(busy=True)
DONE = Vote(shutdown=True)
FAILED = Vote(shutdown=True, leaving="ValueError: boom")


def test_no_vote_ends_nothing() -> None:
    assert not set_ends([RUN, BUSY], {"x": [1]})


def test_a_failing_rank_ends_the_set_at_once_whatever_is_pending() -> None:
    assert set_ends([RUN, FAILED, BUSY], {"x": [0, 2]})


def test_a_finished_rank_waits_until_nothing_is_pending_anywhere() -> None:
    assert not set_ends([DONE, BUSY], {})  # a peer's op still needs rounds (the fast lane)
    assert not set_ends([DONE, RUN], {"x": [1]})  # a name still in the table
    assert set_ends([DONE, RUN], {})  # quiet: the set ends, the peer's next op would hang
    assert set_ends([DONE, DONE], {"x": [0]})  # everyone voted


def test_names_a_finished_rank_never_submitted_are_doomed() -> None:
    table = {"a": [0, 1], "b": [1], "c": [1, 2]}
    assert doomed([DONE, RUN, RUN], table, joined=()) == {"b": [0], "c": [0]}
    assert doomed([DONE, RUN, RUN], table, joined=[0]) == {}  # a joined rank stands in


def test_the_error_names_the_failed_rank_first_with_its_words() -> None:
    e = error([DONE, RUN, FAILED], me=1, ranks=[4, 5, 6], set_id=2)
    assert isinstance(e, PeerFailedError) and e.ranks == (6, 4)
    text = str(e)
    assert text.startswith("ringtrain has been shut down on process set 2: rank 6 failed ")
    assert "(ValueError: boom)" in text and "rank 4 left the set (its script ended" in text
    assert "HINT: the failure above is the cause" in text


def test_a_rank_that_left_a_set_may_have_removed_it() -> None:
    # Not "shut down": the rank may go on in the world, having called remove_process_set alone.
    e = error([RUN, DONE], me=0, ranks=[2, 3], set_id=1)
    assert str(e) == (
        "ringtrain has been shut down on process set 1: rank 3 left the set (its script ended, "
        "or it called shutdown() or remove_process_set()), before this collective completed.\n"
        "HINT: every rank must submit the same collectives; a rank that ran fewer ends the "
        "others' (Horovod's rule); for uneven data, end every rank at the same step (the "
        "smallest count over the ranks: an allreduce with op=Min), or, where the others run "
        "only explicit collectives, call ringtrain.join() in a rank whose data ran out (it does "
        "not stand in for step()). Every rank of the world calls remove_process_set alike."
    )


def test_a_finished_peer_is_named_with_horovods_rule() -> None:
    e = error([RUN, DONE], me=0, ranks=[0, 1], set_id=0)
    assert isinstance(e, PeerFailedError) and "ringtrain.join()" in str(e)
    only = error([DONE, RUN, DONE], me=1, ranks=[0, 1, 2], set_id=0, only=[2])
    assert isinstance(only, PeerFailedError) and only.ranks == (2,)


def test_a_rank_that_shuts_down_itself_gets_the_plain_error() -> None:
    e = error([DONE, DONE], me=0, ranks=[0, 1], set_id=0)
    assert type(e) is CollectiveAbortedError

"""Consistency checks off (init(check_consistency=False), RINGTRAIN_CHECK_CONSISTENCY=0): errors a
rank found in its own arguments are still raised, on every rank, and the cross-set check is off
too (docs/diagnostics.md). Shape mismatches on the inline path: test_allreduce.py."""

from __future__ import annotations

import torch

import ringtrain as rt
from ringtrain.testing.spawn import World

PAIR = (0, 1)


def _own_argument_errors() -> list[str]:
    said = []
    for op in (
        # Every rank names a root outside the world.
        lambda: rt.broadcast(torch.ones(2), root_rank=5, name="off.root"),
        # Only rank 1 is wrong: rank 0's valid request must fail with it, not wait or run.
        lambda: rt.allreduce(
            torch.ones(2).to_sparse() if rt.rank() == 1 else torch.ones(2), name="off.sparse"
        ),
    ):
        try:
            op()
        except rt.CollectiveArgumentError as e:
            said.append(str(e))
        else:
            said.append("no error")
    # The controller lives on.
    said.append(str(rt.allreduce(torch.ones(1), op=rt.Sum, name="off.after").item()))
    return said


def test_errors_in_a_ranks_own_arguments_are_still_raised(world2: World) -> None:
    for root, sparse, after in world2.run(_own_argument_errors, check_consistency=False):
        assert "'off.root' was invalid: root_rank 5 is not a member" in root, root
        assert "'off.sparse' was invalid: allreduce got a sparse tensor" in sparse, sparse
        assert after == "2.0"


def _two_sets_one_name() -> tuple[str, str]:
    # As in test_crossset.py: rank 0 submits "x" on the pair, ranks 1 and 2 on the world.
    pair = rt.add_process_set(list(PAIR))
    rt.allreduce(torch.ones(1), name="start")
    ps = pair if rt.rank() == 0 else rt.global_process_set
    try:
        rt.allreduce(torch.ones(2), name="x", process_set=ps)
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


def test_the_cross_set_check_is_off_too(world3: World) -> None:
    # With checks on this fails as a mismatch after about a second (test_crossset.py); the stall
    # shutdown comes well after that. Off, nothing compares the sets: both waits stall until the
    # stall shutdown ends them, and the job with them (whichever rank stops first, the others'
    # waits may end as its shutdown instead).
    results = world3.run(
        _two_sets_one_name,
        timeout=90,
        check_consistency=False,
        stall_warning_s=1.0,
        stall_shutdown_s=8.0,
    )
    kinds = [kind for kind, _ in results]
    assert "StallError" in kinds, results
    assert set(kinds) <= {"StallError", "PeerFailedError"}, results
    for kind, msg in results:
        assert "different process sets" not in msg, msg
        assert kind != "StallError" or "stopping the job" in msg, msg

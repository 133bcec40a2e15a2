"""A collective found invalid names every rank that passed the invalid argument, not only the
lowest: a root outside the set passed by every rank read "invalid on rank 0", sending the user
to look for a branch on rank 0."""

from __future__ import annotations

from ringtrain.collectives.requests import Request, TensorMeta, mismatch

ROOT_5 = "root_rank 5 is not a member of the process set (ranks [0, 1, 2, 3])."


def _req(error: str = "") -> Request:
    return Request("x", "broadcast", (TensorMeta((3,), "torch.float32"),), root=5, error=error)


def test_every_rank_with_the_error_is_named() -> None:
    every = {r: _req(ROOT_5) for r in range(4)}
    assert mismatch("x", every) == f"collective 'x' was invalid on ranks 0-3: {ROOT_5}"
    # Ranks given by their world rank on a process set, as elsewhere in these messages.
    two = {0: _req(), 1: _req(ROOT_5), 2: _req(), 3: _req(ROOT_5)}
    assert mismatch("x", two, set_ranks=[4, 5, 6, 7]) == (
        f"collective 'x' was invalid on ranks 5,7: {ROOT_5}"
    )
    one = {0: _req(), 1: _req(), 2: _req(), 3: _req("allreduce expects a torch.Tensor, got list")}
    assert mismatch("x", one) == (
        "collective 'x' was invalid on rank 3: allreduce expects a torch.Tensor, got list"
    )

"""Which errors make ``@elastic.run`` re-form the world: a peer's failure, not a caller's mistake."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import ringtrain.torch as hvd
from ringtrain.elastic.run import peer_failed
from ringtrain.errors import (
    CollectiveAbortedError,
    CollectiveArgumentError,
    CollectiveMismatchError,
    HorovodInternalError,
)


def test_every_collective_error_is_a_horovod_internal_error() -> None:
    # Horovod users write `except hvd.HorovodInternalError`; it must catch ringtrain's failures.
    for cls in (CollectiveMismatchError, CollectiveArgumentError, CollectiveAbortedError):
        assert issubclass(cls, hvd.HorovodInternalError) and issubclass(cls, RuntimeError)
    assert hvd.HorovodInternalError is HorovodInternalError is hvd.elastic.HorovodInternalError


@pytest.mark.parametrize(
    "error",
    [
        HorovodInternalError("peer gone"),
        CollectiveAbortedError("aborted"),
        dist.DistError("Connection closed by peer"),
        RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset"),
        ConnectionResetError("ringtrain's TCP mesh: the peer closed the connection"),
    ],
)
def test_a_peer_failure_resets(error: BaseException) -> None:
    assert peer_failed(error)


@pytest.mark.parametrize(
    "error",
    [
        CollectiveMismatchError("rank 0 sent shape [2], rank 1 sent [3]"),
        CollectiveArgumentError("root 5 is not a member"),
        RuntimeError("a bug in the training script"),
        ValueError("bad input"),
    ],
)
def test_a_mistake_that_would_fail_again_ends_the_job(error: BaseException) -> None:
    assert not peer_failed(error)

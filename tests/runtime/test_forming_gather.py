"""The first exchange of an elastic world (``runtime/forming_gather``): its waits end once a
newer world is announced, whether the gather hangs or fails on a lost peer; outside a
replacement it gathers as torch's ``all_gather_object`` does, and a failure not followed by an
announcement is raised as it was."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from ringtrain.runtime import forming_gather
from ringtrain.runtime.arrivals import WorldSuperseded

REFUSED = "[gloo/transport/tcp/pair.cc:152] timed out connecting: SO_ERROR: Connection refused"


class HungWork:
    """A work that never completes: each wait's slice runs out, as Gloo says it."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        time.sleep(0.01)
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 500ms")


class FailedWork:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waits += 1
        raise RuntimeError(REFUSED)


def after(seconds: float) -> object:
    at = time.monotonic() + seconds
    return lambda: time.monotonic() >= at


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forming_gather, "SLICE_S", 0.02)


def test_a_hung_exchange_ends_once_a_newer_world_is_announced() -> None:
    start = time.monotonic()
    with pytest.raises(WorldSuperseded):
        forming_gather._wait(HungWork(), after(0.2), timeout_s=60)  # type: ignore[arg-type]
    assert time.monotonic() - start < 5


def test_a_refused_connect_waits_for_the_announcement_not_for_the_work() -> None:
    work = FailedWork()
    with pytest.raises(WorldSuperseded) as caught:
        forming_gather._wait(work, after(0.2), timeout_s=60)  # type: ignore[arg-type]
    assert work.waits == 1  # a failed work is not waited on again
    assert REFUSED in str(caught.value.__cause__)


def test_a_failure_with_no_newer_world_is_raised_after_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(forming_gather, "ANNOUNCE_GRACE_S", 0.2)
    with pytest.raises(RuntimeError, match="Connection refused"):
        forming_gather._wait(FailedWork(), lambda: False, timeout_s=60)  # type: ignore[arg-type]


def test_a_hung_exchange_with_no_newer_world_ends_at_the_transport_timeout() -> None:
    with pytest.raises(RuntimeError, match="Timed out waiting"):
        forming_gather._wait(HungWork(), lambda: False, timeout_s=0.2)  # type: ignore[arg-type]


def test_it_gathers_every_ranks_object_in_rank_order() -> None:
    """Two ranks (two Gloo groups over one store, a thread each) with pickles of unequal size."""
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=30)
    objects = [{"host": "a", "address": "198.18.0.1"}, ("b" * 300, 7)]
    got: dict[int, list[object]] = {}

    def rank(r: int) -> None:
        group = dist.ProcessGroupGloo(store, r, 2, timeout)
        got[r] = forming_gather.all_gather_object(objects[r], 2, group, lambda: False, 30)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got == {0: objects, 1: objects}

"""step() waiting on a rank that stopped taking steps names that rank (engine_wait)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.diagnostics.engine_wait import FINISHED, WaitWatch, explain, finished_key
from ringtrain.testing.spawn import World


def test_explain_names_each_rank_by_where_it_is() -> None:
    msg = explain(0, 7, 61.0, {0: 7, 1: 7, 2: 9, 3: FINISHED, 4: None}, 300.0)
    assert msg.startswith("ringtrain: step() has waited 61 s for the gradients of step 7;")
    assert "ranks [0, 1] wait there" in msg
    assert "rank 2 waits in step 9: it ran 2 step(s) more than these ranks" in msg
    assert "ranks [3] have finished (ringtrain.shutdown()): they ran fewer steps" in msg
    assert "ranks [4] are not waiting in step()" in msg
    assert "ringtrain.join()" in msg and "(300 s, RINGTRAIN_TIMEOUT_S)" in msg


class _Store:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


def _wait_for(cond: object, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_long_wait_is_posted_reported_once_and_taken_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = _Store()
    store.set(finished_key(1), "1")
    watch = WaitWatch(store, "p", 0, [0, 1], warning_s=0.2, timeout_s=300.0)
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        watch.begin(3)
        _wait_for(lambda: "p/waiting/0" in store.data)  # posted at half the warning time
        assert store.data["p/waiting/0"] == b"3"
        _wait_for(lambda: caplog.records)
        time.sleep(0.3)
    assert len(caplog.records) == 1  # once per wait
    assert "ranks [1] have finished" in caplog.records[0].getMessage()
    watch.end()
    _wait_for(lambda: "p/waiting/0" not in store.data)  # taken back when the wait ends
    # A short wait writes nothing.
    watch.begin(4)
    watch.end()
    time.sleep(0.2)
    assert "p/waiting/0" not in store.data
    watch.close()


def test_the_lowest_waiting_rank_speaks_for_all(caplog: pytest.LogCaptureFixture) -> None:
    store = _Store()
    store.set("p/waiting/0", "3")  # rank 0 waits in the same step and reports
    watch = WaitWatch(store, "p", 1, [0, 1], warning_s=0.1, timeout_s=300.0)
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        watch.begin(3)
        _wait_for(lambda: "p/waiting/1" in store.data)
        time.sleep(0.3)
    watch.end()
    watch.close()
    assert not caplog.records


def test_all_waiting_together_is_a_slow_exchange_not_a_stall(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = _Store()
    store.set("p/waiting/1", "3")
    watch = WaitWatch(store, "p", 0, [0, 1], warning_s=0.1, timeout_s=300.0)
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        watch.begin(3)
        _wait_for(lambda: "p/waiting/0" in store.data)
        time.sleep(0.3)
    watch.end()
    watch.close()
    assert not caplog.records


def _uneven_steps() -> tuple[str, str]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("ringtrain").addHandler(handler)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        opt = rt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
        )
        # Rank 1's data runs out one step early; it leaves, rank 0 waits for it.
        error = ""
        for _ in range(4 if rt.rank() == 0 else 3):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
            try:
                opt.step()
            except Exception as e:  # the transport's timeout
                error = f"{type(e).__name__}: {e}"
                break
        return error, "\n".join(r for r in records if "step() has waited" in r)
    finally:
        logging.getLogger("ringtrain").removeHandler(handler)


def test_a_rank_that_finished_early_is_named_while_the_other_waits(world2: World) -> None:
    (error, report), (other_error, other_report) = world2.run(
        _uneven_steps, stall_warning_s=1.0, timeout_s=6.0, timeout=60
    )
    assert error, "rank 0's last step should have timed out"
    assert "step() has waited 1 s for the gradients of step 4; ranks [0] wait there" in report
    assert "ranks [1] have finished (ringtrain.shutdown())" in report
    assert other_error == other_report == ""

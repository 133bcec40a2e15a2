"""A torchrun-style launch (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, no launcher to check
first) whose MASTER_PORT another program holds: rank 0 fails at once naming the port, and
rank 1, which finds a listener that never answers as a store, fails within seconds naming it
too, instead of waiting (TCPStore alone waits for ever there)."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringtrain.errors import LaunchEnvironmentError
from ringtrain.runtime import store_connect

# The ranks wait ANSWER (given as argv[1]) for an answer instead of store_connect.ANSWER_S's
# 15 s: the same wait, on a thread the rank stops waiting for, only shorter.
ANSWER = 3.0
RANK = """
import sys, time
import ringtrain.torch as hvd
from ringtrain.errors import LaunchEnvironmentError
from ringtrain.runtime import store_connect
store_connect.ANSWER_S = float(sys.argv[1])
t = time.monotonic()
try:
    hvd.init()
except LaunchEnvironmentError as e:
    print(f"after {time.monotonic() - t:.1f} s: {e}", flush=True)
    raise SystemExit(3)
"""


@pytest.mark.timeout(240)
def test_a_taken_master_port_is_named_by_both_ranks_within_seconds(tmp_path: Path) -> None:
    holder = socket.socket()  # another program's port: it accepts, it never answers
    holder.bind(("127.0.0.1", 0))
    holder.listen(8)
    port = holder.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGTRAIN_", "HOROVOD_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    env["RINGTRAIN_TIMEOUT_S"] = "300"  # the store's whole wait: not what rank 1 waits
    assert store_connect.ANSWER_S == 15.0  # what docs/launch.md says the ranks wait
    procs = []
    try:
        for rank in (0, 1):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", RANK, str(ANSWER)],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=tmp_path,
                )
            )
        outs = [p.communicate(timeout=200) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        holder.close()
    (out0, err0), (out1, err1) = outs
    assert [p.returncode for p in procs] == [3, 3], (err0[-2000:], err1[-2000:])
    assert f"port {port} on 127.0.0.1 is already in use by another program" in out0
    assert f"what listens at 127.0.0.1:{port} does not answer as a rendezvous store" in out1
    for out in (out0, out1):
        assert "HINT: choose a free port (MASTER_PORT, torchrun --master-port)" in out
        assert float(out.split()[1]) < 40, out  # "after 5.1 s: ..."; not timeout_s's 300
    assert float(out1.split()[1]) >= ANSWER, out1  # it gave the listener its time to answer


def test_a_rank_that_finds_nothing_listening_says_so_every_period_then_names_the_store(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/launch.md: while nothing listens at the store's address, a warning every
    SAY_EVERY_S (30 s; shortened here), and at timeout_s an error naming the address."""
    monkeypatch.setattr(store_connect, "SAY_EVERY_S", 0.5)
    with socket.socket() as s:  # a port that was free a moment ago, and that nobody serves now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, "ringtrain"),
        pytest.raises(LaunchEnvironmentError) as info,
    ):
        store_connect.connect(1, "127.0.0.1", port, is_master=False, timeout_s=2.2)
    assert time.monotonic() - started < 30
    assert str(info.value).startswith(
        f"rank 1 could not reach the rendezvous store at 127.0.0.1:{port}: nothing listened "
        "there within timeout_s=2.2 s.\nHINT: "
    )
    said = [r for r in caplog.records if "still waiting for the rendezvous store" in r.message]
    # At about 0.5, 1.0, 1.5 and 2.0 s; at least twice however loaded the machine.
    assert len(said) >= 2
    gaps = [b.created - a.created for a, b in itertools.pairwise(said)]
    assert min(gaps) >= 0.5

"""Placement variables have one writer (launch/rank_env.py), whatever front end starts ranks."""

from __future__ import annotations

import re
from pathlib import Path

import ringtrain
from ringtrain.environ import Horovod, Ringtrain
from ringtrain.launch import rank_env
from ringtrain.launch.plan import ProcessSpec

SRC = Path(ringtrain.__file__).parent
NAMES = (
    "RANK",
    "SIZE",
    "LOCAL_RANK",
    "LOCAL_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
    "HOSTNAME",
    "RENDEZVOUS_ADDR",
    "RENDEZVOUS_PORT",
    "RENDEZVOUS_HOSTED",
    "GLOO_RENDEZVOUS_ADDR",
    "GLOO_RENDEZVOUS_PORT",
)
_NAME = rf"(Ringtrain|Horovod)\.({'|'.join(NAMES)})\b"
# A write: a dict key (`Ringtrain.RANK: ...`), an item assignment or environ.set_var/setdefault.
WRITES = re.compile(rf"{_NAME}\s*:(?!=)|\[{_NAME}\]\s*=[^=]|(set_var|setdefault)\(\s*{_NAME}")


def test_no_other_module_writes_placement_variables() -> None:
    writers = {
        str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if WRITES.search(path.read_text())
    }
    assert writers == {"launch/rank_env.py"}, writers


def test_the_pattern_sees_each_kind_of_write() -> None:
    for line in (
        "    Ringtrain.RANK: str(rank),",
        "env[Horovod.SIZE] = '2'",
        "environ.set_var(Ringtrain.RENDEZVOUS_PORT, port)",
    ):
        assert WRITES.search(line), line
    for read in ("env.get(Ringtrain.RANK)", "_int(env, Ringtrain.RANK, 'x')", "x == Horovod.SIZE"):
        assert not WRITES.search(read), read


def test_what_each_front_end_gets() -> None:
    bare = rank_env.variables(1, 4, "10.0.0.1", 29500)
    assert bare == {
        Ringtrain.RANK: "1",
        Ringtrain.SIZE: "4",
        Ringtrain.RENDEZVOUS_ADDR: "10.0.0.1",
        Ringtrain.RENDEZVOUS_PORT: "29500",
        Ringtrain.RENDEZVOUS_HOSTED: "1",
    }
    spec = ProcessSpec(5, 8, "b", 1, 1, 4, 1, 2, ())
    full = rank_env.placement(spec, rank_env.Rendezvous("10.0.0.1", 29500, "job"), hosted=False)
    for ours, theirs, value in (
        (Ringtrain.RANK, Horovod.RANK, "5"),
        (Ringtrain.LOCAL_RANK, Horovod.LOCAL_RANK, "1"),
        (Ringtrain.LOCAL_SIZE, Horovod.LOCAL_SIZE, "4"),
        (Ringtrain.CROSS_RANK, Horovod.CROSS_RANK, "1"),
        (Ringtrain.CROSS_SIZE, Horovod.CROSS_SIZE, "2"),
        (Ringtrain.HOSTNAME, Horovod.HOSTNAME, "b"),
    ):
        assert full[ours] == full[theirs] == value, ours
    assert full[Ringtrain.RENDEZVOUS_HOSTED] == "0"
    assert full[Horovod.GLOO_RENDEZVOUS_PORT] == "29500" and full[Ringtrain.JOB_ID] == "job"

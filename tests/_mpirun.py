"""What a test needs to run plain ``mpirun`` (Debian's openmpi-bin) on this machine."""

from __future__ import annotations

import os

# The tests run as root, which mpirun refuses without these; oversubscribe: more ranks than the
# 2 cores it counts.
MPIRUN_ONLY = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}


def mpirun_env() -> dict[str, str]:
    """This process's environment without anything that could hand ranks a rendezvous (a
    test's own launcher, or the suite's), plus what lets mpirun run here."""
    drop = ("MASTER_", "RINGTRAIN_", "GLOO_", "OMPI_", "PMIX_", "RANK", "WORLD_SIZE", "LOCAL_")
    # And ATen's kernel choice (a suite run with ATEN_CPU_CAPABILITY=default): plain mpirun
    # gives it to the ranks of its own host and not to another host's (that takes -x), so the
    # hosts' weights would differ in their last bits; the CPU's own choice is the same on both.
    drop += ("ATEN_CPU_CAPABILITY",)
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, **MPIRUN_ONLY}

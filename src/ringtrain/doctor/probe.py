"""The doctor's per-host probe: ``python -m ringtrain.doctor.probe COMMAND``.

Run by ``ringtrain doctor`` on every host, locally or over ssh as the launcher starts its agents.
Each command prints its results as marked JSON lines (:mod:`ringtrain.doctor.wire`):

    facts       torch and its backends, cores, hyper-threading, NUMA, allocator, OMP/MKL
                settings, interfaces. torch is imported here, never in the doctor itself, and
                a host without torch still reports everything else.
    serve       the receiving end of the link test, on one address (until stdin closes)
    send        the sending end: latency and bandwidth to one or more receivers
    allreduce   run as every rank of a tiny ringtrain job: allreduce bus bandwidth per size
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import resource
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import psutil

import ringtrain
from ringtrain import environ
from ringtrain.doctor import linktest
from ringtrain.doctor.wire import emit, parse_sizes

# Thread settings worth showing: they decide how many threads each rank starts.
THREAD_VARS = environ.THREAD_VARS
_ALLOCATOR_LIB = re.compile(r"lib(jemalloc|tcmalloc(?:_minimal)?|mimalloc)[^/\s]*\.so")


# ---- facts -------------------------------------------------------------------------------------


def _torch_facts() -> dict[str, Any]:
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install raising anything
        return {"error": f"{type(e).__name__}: {e}"}
    import torch.distributed as dist

    facts: dict[str, Any] = {"version": torch.__version__}
    available = dist.is_available()
    facts["distributed"] = available
    for backend in ("gloo", "nccl", "mpi"):
        check = getattr(dist, f"is_{backend}_available", None)
        facts[backend] = bool(available and check is not None and check())
    cuda: dict[str, Any] = {"available": torch.cuda.is_available(), "version": torch.version.cuda}
    if cuda["available"]:
        cuda["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    else:
        cuda["devices"] = []
    facts["cuda"] = cuda
    facts["num_threads"] = torch.get_num_threads()
    facts["num_interop_threads"] = torch.get_num_interop_threads()
    facts["mkl"] = bool(torch.backends.mkl.is_available())
    facts["mkldnn"] = bool(torch.backends.mkldnn.is_available())
    facts["openmp"] = bool(torch.backends.openmp.is_available())
    # ATen's kernels here (AVX512, AVX2, DEFAULT, ...): hosts that differ compute differently.
    facts["cpu_capability"] = str(torch.backends.cpu.get_cpu_capability())
    with contextlib.suppress(Exception):
        info = torch.__config__.parallel_info()
        m = re.search(r"ATen parallel backend: (.+)", info)
        facts["parallel_backend"] = m.group(1).strip() if m else ""
    return facts


def _preloaded() -> list[str]:
    """Allocator libraries mapped into this process (LD_PRELOAD or linked)."""
    try:
        with open("/proc/self/maps") as f:
            text = f.read()
    except OSError:
        return []
    return sorted({m.group(0) for m in _ALLOCATOR_LIB.finditer(text)})


def facts() -> dict[str, Any]:
    """Everything the doctor shows about this host."""
    env = environ.current()
    from ringtrain.host import cpu_limits, network
    from ringtrain.launch import agent

    base = agent.host_facts()
    siblings = cpu_limits.smt_siblings(base["cpus"])
    logical = psutil.cpu_count(logical=True) or len(base["cpus"])
    physical = psutil.cpu_count(logical=False) or logical
    per_core = max(1, round(logical / physical))
    out: dict[str, Any] = {
        "hostname": base["hostname"],
        "python": base["python"],
        "executable": sys.executable,
        "ringtrain": ringtrain.__version__,
        "platform": platform.platform(),
        "cpu": {
            "logical": logical,
            "physical": physical,
            "threads_per_core": per_core,
            "hyperthreading": per_core > 1,
            "usable": len(base["cpus"]),  # this process's affinity (cgroups, taskset)
            "cpus": base["cpus"],
            "quota": base["cpu_quota"],  # CPUs' worth of time (cgroup cpu.max), or None
            # Hardware threads of one core, as groups of CPU numbers (only cores with 2+).
            "smt_groups": sorted({s for s in siblings.values() if len(s) > 1}),
            "model": _cpu_model(),
        },
        "numa_nodes": base["numa_nodes"],
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else [],
        "allocator": {"available": base["allocators"], "preloaded": _preloaded()},
        "threads_env": {k: env[k] for k in THREAD_VARS if k in env},
        # (soft, hard) RLIMIT_NOFILE: a rank's sockets grow with the ranks (host/open_files.py)
        "open_files": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
    }
    try:
        out["interfaces"] = [i.to_dict() for i in network.local_interfaces()]
    except Exception as e:  # advisory: the doctor reports a host without interfaces
        out["interfaces"] = []
        out["interfaces_error"] = str(e)
    out["torch"] = _torch_facts()
    return out


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


# ---- allreduce ---------------------------------------------------------------------------------

# Seconds of each compute probe, and the probes each rank of the allreduce job takes: the spread
# of a rank's probes says how far apart two hosts must be before their difference is not noise
# (one 0.3 s probe read 73.5 and 86.9 GFLOP/s on two identical hosts).
COMPUTE_SECONDS = 0.1
COMPUTE_PROBES = 5
_MATMUL = 256


def compute_gflops(seconds: float) -> float:
    """This process's fp32 matrix-multiply rate (GFLOP/s) over about ``seconds``, on the
    threads torch has: how fast the rank computes, for shares of the global batch by speed."""
    import torch

    a = torch.rand(_MATMUL, _MATMUL)
    b = torch.rand(_MATMUL, _MATMUL)
    torch.mm(a, b)  # warm-up
    ops, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        torch.mm(a, b)
        ops += 1
    return 2 * _MATMUL**3 * ops / max(elapsed, 1e-9) / 1e9


def allreduce(sizes: Sequence[int], budget_s: float, per_size_s: float, max_iters: int) -> int:
    """Bus bandwidth of ringtrain's allreduce at each size; rank 0 prints the result.

    Every decision (iterations, stopping early) is taken on values max-reduced over the ranks,
    so all ranks take it alike. Each sample is the slowest rank's time.
    """
    import torch

    from ringtrain import lifecycle
    from ringtrain.collectives import lane, ops
    from ringtrain.runtime import queries

    lifecycle.init()
    rank, n = queries.rank(), queries.size()
    points: list[dict[str, Any]] = []
    spent = 0.0

    def slowest(seconds: float, name: str) -> float:
        t = ops.allreduce(torch.tensor([seconds], dtype=torch.float64), op="max", name=name)
        return float(t.item())

    # Every rank's compute rate, all at once (as ranks compute in a job): batch_shares' advice.
    slowest(0.0, "doctor.compute.start")
    rates = torch.zeros(n * COMPUTE_PROBES, dtype=torch.float64)
    for j in range(COMPUTE_PROBES):
        rates[rank * COMPUTE_PROBES + j] = compute_gflops(COMPUTE_SECONDS)
    every = [float(v) for v in ops.allreduce(rates, op="sum", name="doctor.compute").tolist()]
    samples = [every[r * COMPUTE_PROBES : (r + 1) * COMPUTE_PROBES] for r in range(n)]
    gflops = [statistics.median(s) for s in samples]

    for k, nbytes in enumerate(sizes):
        # One name for every op of a size, as a training step repeats its collectives: after
        # the warm-up the ops ride the fast lane, with no negotiation round each (the fixed
        # cost per collective the prediction takes from the smallest size is then a step's,
        # not a negotiated op's: about 2x larger at 64 KiB, 2 ranks on one host).
        name = f"doctor.allreduce.{nbytes}"
        tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        # Warm-up ops, all under the size's name, as `bench allreduce` runs them (its
        # bench/timing.py says why): the lane's reservation, still the previous size's, is given
        # up after lane.SWITCH_AFTER negotiated ops, then reopens for this name (4 ops in all
        # were not always enough: 19 of 20 timed 1 MiB ops on the lane, once).
        for _ in range(lane.SWITCH_AFTER + 4):
            t0 = time.perf_counter()
            ops.allreduce(tensor, op="sum", name=name)
        warm = slowest(time.perf_counter() - t0, f"doctor.warmup_time.{nbytes}")
        iters = int(max(1, min(max_iters, per_size_s // max(warm, 1e-6))))
        slowest(0.0, f"doctor.barrier.{nbytes}")
        lane_before = ops.controller_of(None).lane_slots[0]
        t0 = time.perf_counter()
        for _ in range(iters):
            ops.allreduce(tensor, op="sum", name=name)
        elapsed = slowest(time.perf_counter() - t0, f"doctor.time.{nbytes}")
        on_lane = ops.controller_of(None).lane_slots[0] - lane_before
        seconds = elapsed / iters
        busbw = 2 * (n - 1) / n * nbytes / seconds if n > 1 and seconds > 0 else 0.0
        point = {"bytes": nbytes, "iters": iters, "seconds": seconds, "busbw": busbw}
        points.append({**point, "on_lane": on_lane})
        spent += warm + elapsed
        # The next size's warm-up and one timed op, at this size's rate: over the budget, stop
        # here (on a 10 Mbit/s link 8 MiB would take seconds per op).
        if k + 1 < len(sizes) and spent + 2 * seconds * sizes[k + 1] / nbytes > budget_s:
            break
    topo = {"world": n, "local_size": queries.local_size(), "cross_size": queries.cross_size()}
    lifecycle.shutdown()
    if rank == 0:
        compute = {"compute_gflops": gflops, "compute_samples": samples}
        emit(
            sys.stdout, {"allreduce": points, **compute, "compute_probe_s": COMPUTE_SECONDS, **topo}
        )
    return 0


# ---- command line ------------------------------------------------------------------------------


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _watchdog(seconds: float) -> None:
    """A probe must never outlive the doctor's patience, whatever it is stuck in."""

    def expire() -> None:
        time.sleep(seconds)
        sys.stderr.write(f"ringtrain probe: gave up after {seconds:.0f} s\n")
        sys.stderr.flush()
        os._exit(3)

    threading.Thread(target=expire, daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ringtrain.doctor.probe", description=__doc__)
    p.add_argument("--deadline", type=float, default=300.0, help="exit after this many seconds")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("facts")
    s = sub.add_parser("serve")
    s.add_argument("--bind", required=True)
    t = sub.add_parser("send")
    t.add_argument("--to", action="append", required=True, metavar="ADDRESS:PORT")
    t.add_argument("--seconds", type=float, default=1.0)
    t.add_argument("--rtts", type=int, default=20)
    t.add_argument("--connect-timeout", type=float, default=10.0)
    a = sub.add_parser("allreduce")
    a.add_argument("--sizes", type=_sizes, default=_sizes("64K,1M,8M"))
    a.add_argument("--budget", type=float, default=6.0, help="seconds for all sizes together")
    a.add_argument("--per-size", type=float, default=0.3, help="seconds of timed ops per size")
    a.add_argument("--max-iters", type=int, default=20)
    args = p.parse_args(argv)
    _watchdog(args.deadline)
    if args.cmd == "facts":
        emit(sys.stdout, {"facts": facts()})
        return 0
    if args.cmd == "serve":
        return linktest.serve(args.bind, args.deadline)
    if args.cmd == "send":
        for target in args.to:
            address, _, port = target.rpartition(":")
            result = linktest.measure(
                address, int(port), args.seconds, args.rtts, args.connect_timeout
            )
            emit(sys.stdout, {"link": result})
        return 0
    return allreduce(args.sizes, args.budget, args.per_size, args.max_iters)


if __name__ == "__main__":
    sys.exit(main())

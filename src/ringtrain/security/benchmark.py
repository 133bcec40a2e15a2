"""What secure mode costs: allreduce bus bandwidth of plain Gloo, ringtrain, and sealed ringtrain.

:func:`run` measures, in one job, at each size:

* ``gloo``: ``torch.distributed.all_reduce`` on a plain Gloo group (the floor under everything);
* ``ringtrain``: ``ringtrain.allreduce_`` in plain mode (negotiation + Gloo);
* ``ringtrain-secure``: the same in secure mode (negotiation + sealed ring, every byte
  AES-256-GCM sealed);
* ``sealed``: ``torch.distributed.all_reduce`` on a ``ringtrain_sealed`` group (the sealed ring
  alone, as DDP or the gradient engine see it).

Each figure is the median of ``repeats`` samples with its spread (the slowest rank's time per
sample). Bus bandwidth is 2(n-1)/n * bytes / time, comparable with a link's rate. Ranks are
spawned on this machine (two by default), or the benchmark runs in place under a launcher
(``ringtrain run --secure -np 4 -H ... python -m ringtrain.security.benchmark``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ringtrain.bench import ranks
from ringtrain.bench.stats import Summary, bus_bandwidth
from ringtrain.security import keys

DEFAULT_SIZES = (64 << 10, 1 << 20, 16 << 20, 64 << 20)
IMPLS = ("gloo", "ringtrain", "ringtrain-secure", "sealed")
# Aim for about this many bytes per timed sample, so small sizes are not all timer noise.
SAMPLE_BYTES = 64 << 20


@dataclass(frozen=True)
class Params:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 5
    key_file: str = ""  # empty: the launcher's key (RINGTRAIN_KEY_FD)


@dataclass(frozen=True)
class Point:
    impl: str
    nbytes: int
    seconds: Summary
    busbw: Summary  # bytes/s


@dataclass
class Result:
    size: int
    points: list[Point] = field(default_factory=list)

    def table(self) -> str:
        """A text table: bus bandwidth (median, [min-max]) per size and implementation."""
        head = f"{'size':>9}  " + "  ".join(f"{i:>26}" for i in IMPLS)
        lines = [f"allreduce bus bandwidth, {self.size} ranks, MB/s median [min-max]", head]
        for nbytes in sorted({p.nbytes for p in self.points}):
            cells = []
            for impl in IMPLS:
                p = next((q for q in self.points if q.nbytes == nbytes and q.impl == impl), None)
                b = p.busbw if p else None
                cells.append(
                    f"{b.median / 1e6:9.1f} [{b.min / 1e6:6.1f}-{b.max / 1e6:6.1f}]" if b else "-"
                )
            lines.append(f"{_human(nbytes):>9}  " + "  ".join(f"{c:>26}" for c in cells))
        for nbytes in sorted({p.nbytes for p in self.points}):
            g = self.median(nbytes, "ringtrain")
            s = self.median(nbytes, "ringtrain-secure")
            if g and s:
                lines.append(f"secure/plain at {_human(nbytes)}: {s / g:.2f}")
        return "\n".join(lines)

    def median(self, nbytes: int, impl: str) -> float:
        return next(
            (p.busbw.median for p in self.points if p.nbytes == nbytes and p.impl == impl), 0.0
        )


def run(np: int | None = 2, params: Params | None = None, timeout_s: float = 600.0) -> Result:
    """Measure on ``np`` spawned ranks (or in place under a launcher); rank 0 gets the result."""
    params = params or Params()
    with tempfile.TemporaryDirectory(prefix="ringtrain-bench-key-") as tmp:
        if not params.key_file and not os.environ.get(keys.KEY_FD_VAR):
            path = os.path.join(tmp, "job.key")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(keys.encode_key(keys.generate_job_key()))
            params = Params(params.sizes, params.repeats, path)
        result = ranks.run(
            measure, params, np=np, threads=None, settings={"secure": False}, timeout_s=timeout_s
        )
    assert result is not None or not ranks.under_launcher()
    return result  # type: ignore[return-value]


def measure(params: Params) -> Result:
    """On every rank, with ringtrain initialized in plain mode; leaves it initialized."""
    import torch
    import torch.distributed as dist

    import ringtrain

    n = ringtrain.size()
    result = Result(n)
    plain_cases: dict[str, Callable[[torch.Tensor, str], Any]] = {
        "gloo": lambda t, name: dist.all_reduce(t),
        "ringtrain": lambda t, name: ringtrain.allreduce_(t, name=name, op=ringtrain.Sum),
    }
    secure_cases: dict[str, Callable[[torch.Tensor, str], Any]] = {
        "ringtrain-secure": plain_cases["ringtrain"],
        "sealed": plain_cases["gloo"],  # the default group is the sealed one in secure mode
    }
    samples: dict[tuple[str, int], list[float]] = {}
    _sample(plain_cases, params, samples)
    ringtrain.shutdown()
    ringtrain.init(secure=True, key_file=params.key_file)
    try:
        _sample(secure_cases, params, samples)
    finally:
        ringtrain.shutdown()
        ringtrain.init(secure=False)
    for (impl, nbytes), s in samples.items():
        result.points.append(
            Point(impl, nbytes, Summary.of(s), Summary.of([bus_bandwidth(nbytes, x, n) for x in s]))
        )
    return result


def _sample(
    cases: dict[str, Callable[[Any, str], Any]],
    params: Params,
    out: dict[tuple[str, int], list[float]],
) -> None:
    import torch
    import torch.distributed as dist

    for nbytes in params.sizes:
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        iters = max(1, min(50, SAMPLE_BYTES // max(1, nbytes)))
        for impl, op in cases.items():
            name = f"bench.secure.{impl}.{nbytes}"
            op(t, name)  # warm up: buffers, names, connections
            times = []
            for _ in range(params.repeats):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    op(t, name)
                times.append((time.perf_counter() - t0) / iters)
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            out[(impl, nbytes)] = slowest.tolist()


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringtrain.security.benchmark")
    parser.add_argument("-np", type=int, default=None, help="ranks to spawn (default 2)")
    parser.add_argument("--sizes-kib", type=int, nargs="*", help="sizes in KiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = tuple(k << 10 for k in args.sizes_kib) if args.sizes_kib else DEFAULT_SIZES
    result = run(args.np, Params(sizes, args.repeats))
    if result is not None:
        print(result.table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How a fast-lane slot above 1 MiB keeps the tensor, at 3+ ranks: agree first, copy, or sum
in rank order.

A slot that agrees (``collectives/agreed.py``) sums one value over the lane's group before its
data moves: a ring of 2(N-1) steps. A slot that copies (``Lane._backup_of``) takes the tensor
into the lane's backup buffer, then starts the data at once. A slot that sums in rank order
(``ordered``, as every op up to ``ordered.ALONE_ABOVE_BYTES`` does) needs neither: two one-step
alltoalls, the sum landing aside (a dummy marks every rank's chunk), at the price of adds that
do not overlap the transfer; on 16 cores at 16 ranks it was 1.4-1.6x Gloo up to 1 MiB, and
untried above. This script runs the three in the same ranks, interleaved with torch's own
``all_reduce`` of the same tensor, so each is read as a ratio to raw Gloo paired repeat by
repeat. The lane picks its plan when it opens for a name
(``agreed.agrees`` and ``ordered.alone``, replaced here for the other variants: every rank
replaces them at the same point of the program, as the choice must be alike everywhere), so
each variant has a name of its own and warms up until the lane is its.

Run on 16 cores (2026-12-04, docs/benchmarks/log/2026-12-04-16core-scale.md), the copy lost at
8 ranks (most likely the eight ranks' copies sharing the host's memory bandwidth with the ring)
and won at 16 ranks only at 4 MiB; the lane keeps agreeing at every rank count.

Each repeat times torch, then the two plans (their order flips every repeat), each
``--ops`` ops back to back after a barrier; a sample is the slowest rank's time per op. Prints
per size the median per variant, its ratio to torch's sample of the same repeat (median
[min-max]) and the lane's counters (slots taken, bytes copied), which show that the plan ran.

    ringtrain run -np 8 -x OMP_NUM_THREADS=2 -- python scripts/bench_lane_plan.py
    ringtrain run -np 3 -- .venv/bin/python scripts/bench_lane_plan.py --repeats 2  # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

import ringtrain as rt
from ringtrain.bench.timing import seconds_per_op
from ringtrain.collectives import agreed, ordered
from ringtrain.collectives.ops import controller_of

AGREES, ALONE = agreed.agrees, ordered.alone


def _never(*_: object) -> bool:
    return False


# Per plan: (agreed.agrees, ordered.alone).
PLANS = {"agree": (AGREES, ALONE), "copy": (_never, ALONE), "ordered": (_never, _never)}
WARM_OPS = 8  # enough for the lane to give up the last name and open for this one


def _lane() -> tuple[int, int]:
    fast = controller_of(None)._fast
    return (fast.lane.slots_valid, fast.lane.backup_bytes) if fast is not None else (0, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,16", help="MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--ops", type=int, default=3, help="ops per sample")
    args = parser.parse_args()
    rt.init()
    lines = [f"{rt.size()} ranks; load average {os.getloadavg()[0]:.2f} before"]
    for mib in (int(s) for s in args.sizes.split(",")):
        t = torch.zeros(mib << 18)  # float32; zeros stay zeros, op after op

        def torch_op(t: torch.Tensor = t) -> None:
            dist.all_reduce(t)

        def plan_op(plan: str, t: torch.Tensor = t, mib: int = mib) -> Callable[[], None]:
            agreed.agrees, ordered.alone = PLANS[plan]  # type: ignore[assignment]
            for _ in range(WARM_OPS):
                rt.allreduce_(t, name=f"bench.lane.{plan}.{mib}", op=rt.Sum)
            return lambda: rt.allreduce_(t, name=f"bench.lane.{plan}.{mib}", op=rt.Sum)

        samples: dict[str, list[float]] = {"torch": [], **{p: [] for p in PLANS}}
        counters = {p: [0, 0] for p in PLANS}
        torch_op()
        for rep in range(args.repeats):
            samples["torch"].append(seconds_per_op(torch_op, args.ops))
            for plan in PLANS if rep % 2 == 0 else list(PLANS)[::-1]:
                op = plan_op(plan)
                before = _lane()
                samples[plan].append(seconds_per_op(op, args.ops))
                after = _lane()
                counters[plan][0] += after[0] - before[0]
                counters[plan][1] += after[1] - before[1]
        table = torch.tensor(list(samples.values()), dtype=torch.float64)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)  # the slowest rank's samples
        base = table[0].tolist()
        lines.append(f"{mib} MiB: torch {statistics.median(base) * 1e3:.2f} ms")
        for i, plan in enumerate(PLANS, start=1):
            v = table[i].tolist()
            r = sorted(y / x for x, y in zip(v, base))  # speed relative to torch
            slots, copied = counters[plan]
            lines.append(
                f"  {plan:7s} {statistics.median(v) * 1e3:7.2f} ms, "
                f"{statistics.median(r):.2f}x torch [{r[0]:.2f}-{r[-1]:.2f}]; "
                f"lane slots {slots}, copied {copied >> 20} MiB"
            )
    lines.append(f"load average {os.getloadavg()[0]:.2f} after")
    if rt.rank() == 0:
        print("\n".join(lines), flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()

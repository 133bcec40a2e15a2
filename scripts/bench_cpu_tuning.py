"""Time the demo (examples/train_digits.py) under ``ringtrain run``'s CPU-tuning variants.

Variants run interleaved, round after round, so a change in the machine's load hits them all
alike. For each: the demo's own training time (rank 0's training loop), the job's wall time
(launcher start to exit: imports, rendezvous, training, shutdown) and the summed throughput.
Prints the median and the min-max spread, each variant's median training time relative to the
untuned one, and the load average before and after.

    .venv/bin/python scripts/bench_cpu_tuning.py [--np 2] [--rounds 5] [--epochs 12]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "train_digits.py"
SUMMARY = re.compile(r"throughput: ([\d,]+) samples/s\s+train time: ([\d.]+) s")


def variants(cpus: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Name -> (ringtrain run flags, environment overrides)."""
    return {
        # What a job gets without ringtrain's tuning: torch's default of one thread per core.
        f"bind none, OMP_NUM_THREADS={cpus} (untuned)": (
            ["--bind-to", "none"],
            {"OMP_NUM_THREADS": str(cpus)},
        ),
        "bind none (threads = cores / ranks)": (["--bind-to", "none"], {}),
        "bind core (the default here)": (["--bind-to", "core"], {}),
        "bind core + jemalloc": (["--bind-to", "core", "--malloc", "jemalloc"], {}),
    }


def run_once(
    np: int, flags: list[str], env: dict[str, str], epochs: int, save: str
) -> tuple[float, float, float]:
    """One job: (training time s, wall time s, throughput samples/s)."""
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", str(np), *flags, "--"]
    argv += [sys.executable, "-W", "ignore", str(DEMO), "--epochs", str(epochs)]
    argv += ["--target-accuracy", "0", "--save", save]
    full_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | env
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=600)
    wall = time.perf_counter() - t0
    match = SUMMARY.search(proc.stdout)
    if proc.returncode != 0 or match is None:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return float(match[2]), wall, float(match[1].replace(",", ""))


def _fmt(values: list[float], unit: str) -> str:
    return f"{statistics.median(values):.2f} {unit} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=12, help="the demo's default")
    args = p.parse_args()
    cpus = len(os.sched_getaffinity(0))
    table = variants(cpus)
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in table}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, (flags, env) in table.items():
                results[name].append(run_once(args.np, flags, env, args.epochs, f"{tmp}/w.pt"))
                t, w, _ = results[name][-1]
                print(f"round {r + 1} {name}: train {t:.2f} s, wall {w:.1f} s", flush=True)
    load_after = os.getloadavg()
    untuned = statistics.median(t for t, _, _ in next(iter(results.values())))
    print(
        f"\n{args.np} ranks, {cpus} cores, demo --epochs {args.epochs}, {args.rounds} rounds; "
        "median (min-max); speed-up = untuned median train time / this one"
    )
    print(f"{'variant':42} {'train time':>22} {'speed-up':>8} {'wall time':>22} {'samples/s':>9}")
    for name, rows in results.items():
        trains = [t for t, _, _ in rows]
        walls = [w for _, w, _ in rows]
        rate = statistics.median(x for _, _, x in rows)
        print(
            f"{name:42} {_fmt(trains, 's'):>22} {untuned / statistics.median(trains):7.2f}x "
            f"{_fmt(walls, 's'):>22} {rate:9,.0f}"
        )
    print(
        "load average (1, 5, 15 min): before "
        + " ".join(f"{x:.2f}" for x in load_before)
        + ", after "
        + " ".join(f"{x:.2f}" for x in load_after)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Recovery time after a SIGKILLed rank: ringtrain elastic vs torchrun --max-restarts.

The same model (the digits CNN of examples/train_digits.py), data, batch size and commit
cadence (every COMMIT_EVERY steps) in both jobs, 3 ranks on this host:

* ``ringtrain``: ``ringtrain run -np 3 --min-np 2``, Horovod's elastic API (TorchState with an
  ElasticSampler, DistributedOptimizer); the survivors roll back and re-form in place.
* ``torchrun``: ``torchrun --standalone --nproc-per-node 3 --max-restarts 3``, plain DDP on Gloo
  with a checkpoint file written by rank 0 at each commit; torchrun stops every worker and starts
  a new group, which reloads the checkpoint.

Each rank appends a line per completed step (wall time, step, its world's generation: ringtrain's
membership generation, torchrun's restart count) to its own file. The driver SIGKILLs rank 1 once
step KILL_AFTER is done, and reports the time from the kill to the first step completed in a
newer world (any rank). Every job is then stopped. Run (one host, a few minutes)::

    .venv/bin/python scripts/bench_elastic_recovery.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.time()
ROOT = Path(__file__).resolve().parents[1]
NP, BATCH, COMMIT_EVERY, EPOCHS, KILL_AFTER, LR = 3, 32, 5, 50, 30, 0.01


# ---- the workers -----------------------------------------------------------------------------


def _data() -> tuple:  # type: ignore[type-arg]
    sys.path.insert(0, str(ROOT / "examples"))
    from train_digits import DigitsNet, load  # the demo's model and data

    x_tr, y_tr, _, _ = load(0)
    return DigitsNet, x_tr, y_tr


class StepLog:
    def __init__(self, folder: str) -> None:
        self.f = open(os.path.join(folder, f"steps.{os.getpid()}.jsonl"), "a")  # noqa: SIM115

    def started(self, generation: int) -> None:
        """When this process started (a restarted worker's re-import and reload come after)."""
        line = {"t": STARTED, "start": True, "gen": generation, "pid": os.getpid()}
        self.f.write(json.dumps(line) + "\n")
        self.f.flush()

    def step(self, step: int, rank: int, generation: int) -> None:
        line = {"t": time.time(), "step": step, "rank": rank, "gen": generation, "pid": os.getpid()}
        self.f.write(json.dumps(line) + "\n")
        self.f.flush()


def worker_ringtrain(folder: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import ringtrain.torch as hvd
    from ringtrain.runtime import membership

    net, x_tr, y_tr = _data()
    hvd.init()
    torch.manual_seed(0)
    dataset = TensorDataset(x_tr, y_tr)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    model = net()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR * NP, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0)
    log = StepLog(folder)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < EPOCHS:
            for idx, (x, y) in enumerate(loader):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                state.step += 1
                log.step(state.step, hvd.rank(), membership.current())
                state.sampler.record_batch(idx, BATCH)
                if state.step % COMMIT_EVERY == 0:
                    state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    hvd.shutdown()


def worker_torchrun(folder: str) -> None:
    import itertools

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    net, x_tr, y_tr = _data()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # HACK: with torch 2.13, workers of a restarted group read the previous group's Gloo
    # addresses from torchrun's store ("connectFullMesh failed ... Connection refused") and the
    # restart fails; keys under a prefix per restart avoid it.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt{generation}", store), rank=rank, world_size=size
    )
    torch.manual_seed(0)
    dataset = TensorDataset(x_tr, y_tr)
    sampler = DistributedSampler(dataset, size, rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    model = DistributedDataParallel(net())
    opt = torch.optim.SGD(model.parameters(), lr=LR * size, momentum=0.9)
    ckpt = os.path.join(folder, "checkpoint.pt")
    step = 0
    if os.path.exists(ckpt):  # a restart: resume from the last commit
        saved = torch.load(ckpt, weights_only=False)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        step = saved["step"]
    log = StepLog(folder)
    log.started(generation)
    per_epoch = len(loader)
    while step < EPOCHS * per_epoch:
        epoch, skip = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        for x, y in itertools.islice(loader, skip, None):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
            log.step(step, rank, generation)
            if step % COMMIT_EVERY == 0 and rank == 0:
                tmp = ckpt + ".tmp"
                torch.save(
                    {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                    tmp,
                )
                os.replace(tmp, ckpt)
    dist.destroy_process_group()


# ---- the driver ------------------------------------------------------------------------------


def command(system: str, folder: str) -> list[str]:
    me = [sys.executable, str(Path(__file__).resolve()), "worker", system, folder]
    if system == "ringtrain":
        return [
            sys.executable,
            "-m",
            "ringtrain",
            "run",
            "-np",
            str(NP),
            "--min-np",
            "2",
            "--",
            *me,
        ]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", "--nproc-per-node", str(NP), "--max-restarts", "3", *me[1:]]


def _lines(folder: str) -> list[dict]:  # type: ignore[type-arg]
    out = []
    for p in Path(folder).glob("steps.*.jsonl"):
        for raw in p.read_text().splitlines():
            if raw.endswith("}"):
                out.append(json.loads(raw))
    return out


class JobFailed(RuntimeError):
    pass


def measure(system: str, timeout_s: float = 240.0) -> float:
    """Seconds from SIGKILL of rank 1 to the first step completed in a newer world."""
    with tempfile.TemporaryDirectory(prefix="rt-recovery-") as folder:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            command(system, folder),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: stopped as one at the end
        )
        try:
            deadline = time.monotonic() + timeout_s
            killed_at = None
            while time.monotonic() < deadline:
                time.sleep(0.02)
                lines = _lines(folder)
                if proc.poll() is not None:
                    gens = sorted({x["gen"] for x in lines})
                    tail = proc.stderr.read()[-3000:]  # type: ignore[union-attr]
                    raise JobFailed(
                        f"{system} job ended early (killed: {killed_at is not None}, "
                        f"generations that stepped: {gens}):\n{tail}"
                    )
                if killed_at is None:
                    victims = [x for x in lines if x.get("rank") == 1 and x["step"] >= KILL_AFTER]
                    if victims:
                        os.kill(victims[0]["pid"], signal.SIGKILL)
                        killed_at = time.time()
                    continue
                later = [x["t"] for x in lines if x["gen"] > 0 and "step" in x]
                if later:
                    starts = [x["t"] for x in lines if x["gen"] > 0 and "start" in x]
                    if starts:  # torchrun: how much of it was starting new processes
                        print(
                            f"  {system}: new workers started {min(starts) - killed_at:.2f} s "
                            "after the kill",
                            flush=True,
                        )
                    return min(later) - killed_at
            raise RuntimeError(f"{system}: no recovered step within {timeout_s:.0f} s")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        {"ringtrain": worker_ringtrain, "torchrun": worker_torchrun}[sys.argv[2]](sys.argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--systems", default="ringtrain,torchrun")
    args = parser.parse_args()
    systems = args.systems.split(",")
    times: dict[str, list[float]] = {s: [] for s in systems}
    failures = dict.fromkeys(systems, 0)
    for rep in range(args.repeats):
        for system in systems:  # interleaved, so load on the machine hits both alike
            for _attempt in range(3):
                try:
                    t = measure(system)
                    break
                except JobFailed as e:  # counted and shown: a failed recovery is a result too
                    failures[system] += 1
                    print(f"repeat {rep + 1}: {system} FAILED: {e}", flush=True)
            else:
                continue
            times[system].append(t)
            print(f"repeat {rep + 1}: {system:9s} {t:6.2f} s", flush=True)
    print("\n| job | kill -> next completed step: median [min-max] | runs | failed runs |")
    print("|---|---|---|---|")
    for system, ts in times.items():
        spread = f"{statistics.median(ts):.2f} s [{min(ts):.2f}-{max(ts):.2f}]" if ts else "-"
        print(f"| {system} | {spread} | {len(ts)} | {failures[system]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

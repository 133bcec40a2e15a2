"""Driver programs for tests/ray: run inside a namespace host of a real Ray cluster.

    python ray_job.py MODE OUT_DIR     # prints one line: RESULT <json>

Modes: ``trainer`` (TorchTrainer + RingtrainConfig), ``trainer-torch`` (TorchTrainer with Ray's
own process group; hvd.init() adopts it), ``executor`` (RayExecutor, one worker per host),
``elastic`` (RayExecutor with min_workers: a worker kills itself mid-training),
``elastic-grow`` (ElasticRayExecutor: first a collective fails on one worker alone and the same
workers re-form, then the same kill, then a worker started on a free slot joins),
``raytrain-restart`` (the same kill under Ray Train's elastic restart, for comparison).
Ranks write what they saw into OUT_DIR (one filesystem for every fake host).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import ray

STEPS = 24
KILL_STEP = 12
COMMIT_EVERY = 5
TRIP_STEP = 7  # elastic-grow: rank 0's collective "fails" after this step, in the first world
GROW_WAIT_STEPS = 1000  # elastic-grow: steps of 0.1 s the ranks wait at most for the joiner


def facts(hvd) -> dict:
    import socket

    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "hostname": socket.gethostname(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
    }


def allreduce_check(hvd) -> float:
    import torch

    return float(hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item())


def _read(out_dir: str, name: str) -> str:
    with open(os.path.join(out_dir, name)) as f:
        return f.read()


def _dump(out_dir: str, name: str, data: dict) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(data, f)


def trainer_fn(config: dict) -> None:
    import ray.train
    import torch.distributed

    import ringtrain.torch as hvd

    hvd.init()
    out = facts(hvd)
    out["ray_world_rank"] = ray.train.get_context().get_world_rank()
    out["interface"] = os.environ.get("GLOO_SOCKET_IFNAME")
    out["backend"] = torch.distributed.get_backend()
    out["sum"] = allreduce_check(hvd)
    _dump(config["out_dir"], f"trainer-{hvd.rank()}.json", out)
    hvd.shutdown()


def run_trainer(out_dir: str, own_group: bool) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ringtrain.ray import RingtrainConfig

    kwargs = (
        {}
        if own_group
        else {
            "torch_config": RingtrainConfig(
                network_interface="eth0", secure=True, settings={"timeout_s": 60}
            )
        }
    )
    TorchTrainer(
        trainer_fn,
        train_loop_config={"out_dir": out_dir},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 2}),
        run_config=RunConfig(storage_path=os.path.join(out_dir, "storage"), name="trainer"),
        **kwargs,
    ).fit()
    return {"ranks": [json.loads(_read(out_dir, f"trainer-{r}.json")) for r in range(2)]}


class Executable:
    def __init__(self, tag: str) -> None:
        self.tag = tag


def executor_fn(log: bool = False) -> dict:
    import ringtrain.torch as hvd
    from ringtrain.ray import ray_logger

    hvd.init()
    import torch.distributed as dist

    out = facts(hvd)
    out["sum"] = allreduce_check(hvd)
    out["backend"] = dist.get_backend()
    if log:
        ray_logger.log({"chief": hvd.rank(), "sum": out["sum"]})  # rank 0's only
        ray_logger.log({"every": hvd.rank()}, chief_only=False)
    return out


class Raising:
    """A callback that raises on the first value: reported, called no more, the run goes on."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, value: dict) -> None:
        self.calls += 1
        raise RuntimeError("a callback's own error")


def failing_fn() -> float:
    import torch

    import ringtrain.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("boom in executor rank 1")
    return float(hvd.allreduce(torch.ones(1), name="never.answered").item())


def run_executor(out_dir: str) -> dict:
    from ringtrain.ray import RayExecutor

    ex = RayExecutor(
        RayExecutor.create_settings(timeout_s=60),
        num_hosts=2,
        num_workers_per_host=1,
        cpus_per_worker=1,
        ringtrain_settings={"secure": True},
    )
    ex.start(executable_cls=Executable, executable_args=["made"])
    try:
        ranks = ex.run(executor_fn)
        # A rank that raises: run() raises its error, and the next run() starts afresh (the
        # peer had stayed in its allreduce, and the next run() hung).
        try:
            ex.run(failing_fn)
            failure = ""
        except Exception as e:
            failure = str(e)
        logged: list = []
        raising = Raising()
        again = ex.run(executor_fn, kwargs={"log": True}, callbacks=[raising, logged.append])
        tags = ex.execute(lambda e: e.tag)
        single = ex.execute_single(lambda e: os.getpid())
        remote = ray.get(ex.run_remote(lambda x: x * 2, args=[21]))
    finally:
        ex.shutdown()
    return {
        "ranks": ranks,
        "failure": failure,
        "again": [r["sum"] for r in again],
        "logged": logged,
        "raising_calls": raising.calls,
        "tags": tags,
        "single_pid": single,
        "remote": remote,
    }


def _step_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(16, 1)


def elastic_fn(out_dir: str, grow: bool = False) -> dict:
    """Train STEPS steps; one worker kills itself at KILL_STEP. With ``grow`` the world must
    also grow back to 3 and take 3 steps so before the job ends (a worker started later
    joins): the ranks go on stepping until it has (at most GROW_WAIT_STEPS more steps); and
    before that, in the first world, rank 0 raises after TRIP_STEP the error a collective that
    failed on its side alone raises (no worker leaves: the same three re-form)."""
    import torch

    import ringtrain.torch as hvd
    from ringtrain.errors import CollectiveAbortedError
    from ringtrain.ray import ray_logger
    from ringtrain.runtime import membership

    hvd.init()
    start = facts(hvd)
    if grow:  # every worker, the one started later too: the driver's callbacks take it
        ray_logger.log({"hello": os.getpid()}, chief_only=False)
    marker = os.path.join(out_dir, "killed.json")
    victim = hvd.local_size() == 2 and hvd.local_rank() == 1 and not os.path.exists(marker)
    model = _step_model()
    if os.path.exists(marker):  # a worker started after the kill: only the state sent fixes this
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    # shrunk: a step was taken in a world of fewer than 3; regrown: steps taken since in 3.
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0, shrunk=0, regrown=0)
    log: list = []

    def going_on(state) -> bool:
        if state.step < STEPS:
            return True
        return grow and state.regrown < 3 and state.step < STEPS + GROW_WAIT_STEPS

    @hvd.elastic.run
    def train(state):
        while going_on(state):
            if grow and state.step == TRIP_STEP and membership.current() == 0 and hvd.rank() == 0:
                raise CollectiveAbortedError("a collective failed in transit (the test)")
            g = torch.Generator().manual_seed(state.step)
            x = torch.randn(32, 16, generator=g)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            state.step += 1
            if hvd.size() < 3:
                state.shrunk = 1
            elif state.shrunk:
                state.regrown += 1
            log.append([state.step, time.time(), hvd.size(), hvd.cross_size(), os.getpid()])
            if victim and state.step == KILL_STEP:
                _dump(out_dir, "killed.json", {"time": time.time(), "pid": os.getpid()})
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step % COMMIT_EVERY == 0:
                state.commit()
                if grow:  # rank 0 of the moment's only
                    ray_logger.log({"step": state.step, "size": hvd.size()})
            time.sleep(0.1)

    train(state)
    weights = [float(v) for p in model.parameters() for v in p.detach().flatten()]
    tag = os.environ.get("RT_TEST_ELASTIC_TAG")
    return {
        "start": start,
        "end": facts(hvd),
        "log": log,
        "step": state.step,
        "weights": weights,
        "tag": tag,
    }


def run_elastic_grow(out_dir: str) -> dict:
    """Horovod's ElasticRayExecutor, as its Ray examples build it: 3 workers on 4 slots
    (max_np=3); one is killed, the world shrinks to 2, and the driver starts a worker on a free
    slot that joins (the world grows back to 3)."""
    import functools

    from ringtrain.ray import ElasticRayExecutor

    settings = ElasticRayExecutor.create_settings(min_np=2, max_np=3, timeout_s=60)
    ex = ElasticRayExecutor(settings, cpus_per_slot=1, env_vars={"RT_TEST_ELASTIC_TAG": "grow"})
    ex.start()
    logged: list = []
    results = ex.run(functools.partial(elastic_fn, out_dir, True), callbacks=[logged.append])
    return {
        "results": results,
        "killed": json.loads(_read(out_dir, "killed.json")),
        "logged": logged,
    }


def run_elastic(out_dir: str) -> dict:
    from ringtrain.ray import RayExecutor

    ex = RayExecutor(
        RayExecutor.create_settings(timeout_s=60), min_workers=2, max_workers=3, cpus_per_worker=1
    )
    ex.start()
    try:
        pids = ex.execute(lambda _: os.getpid())
        results = ex.run(elastic_fn, args=[out_dir])
    finally:
        ex.shutdown()
    return {
        "pids": pids,
        "results": results,
        "killed": json.loads(_read(out_dir, "killed.json")),
    }


def raytrain_fn(config: dict) -> None:
    import tempfile

    import ray.train
    import torch
    from ray.train import Checkpoint

    import ringtrain.torch as hvd

    out_dir = config["out_dir"]
    hvd.init()
    victim = hvd.local_size() == 2 and hvd.local_rank() == 1
    model = _step_model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    step = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            saved = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(saved["model"])
        step = saved["step"]
    marker = os.path.join(out_dir, "raytrain-killed.json")
    log_path = os.path.join(out_dir, f"raytrain-{os.getpid()}.jsonl")
    while step < STEPS:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 16, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        step += 1
        with open(log_path, "a") as log:
            log.write(json.dumps([step, time.time(), hvd.size(), os.getpid()]) + "\n")
        if victim and step == KILL_STEP and not os.path.exists(marker):
            _dump(out_dir, "raytrain-killed.json", {"time": time.time(), "pid": os.getpid()})
            os.kill(os.getpid(), signal.SIGKILL)
        if step % COMMIT_EVERY == 0:
            with tempfile.TemporaryDirectory() as d:
                if hvd.rank() == 0:
                    torch.save(
                        {"model": model.state_dict(), "step": step}, os.path.join(d, "state.pt")
                    )
                ray.train.report(
                    {"step": step},
                    checkpoint=Checkpoint.from_directory(d) if hvd.rank() == 0 else None,
                )
        time.sleep(0.1)


def run_raytrain_restart(out_dir: str) -> dict:
    import threading

    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ringtrain.ray import RingtrainConfig

    trainer = TorchTrainer(
        raytrain_fn,
        train_loop_config={"out_dir": out_dir},
        torch_config=RingtrainConfig(settings={"timeout_s": 60}),
        scaling_config=ScalingConfig(num_workers=(2, 3), resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            storage_path=os.path.join(out_dir, "storage"),
            name="restart",
            failure_config=FailureConfig(max_failures=1),
        ),
    )
    failed: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as e:
            failed.append(e)

    threading.Thread(target=fit, daemon=True).start()
    # The measurement is complete once the restarted group logged its last step; Ray Train's
    # own finalization after that takes minutes on the loaded 2-core machine, so it is not
    # waited for (the test stops the whole cluster afterwards).
    while not failed:
        result = _restart_logs(out_dir)
        if result is not None:
            return result
        time.sleep(1.0)
    raise failed[0]


def _restart_logs(out_dir: str) -> dict | None:
    marker = os.path.join(out_dir, "raytrain-killed.json")
    if not os.path.exists(marker):
        return None
    killed = json.loads(_read(out_dir, "raytrain-killed.json"))
    logs = {}
    for name in os.listdir(out_dir):
        if name.startswith("raytrain-") and name.endswith(".jsonl"):
            logs[name] = [json.loads(line) for line in _read(out_dir, name).splitlines() if line]
    after = [log for log in logs.values() if log and log[0][1] > killed["time"]]
    if not after or not all(log[-1][0] == STEPS for log in after):
        return None
    return {"logs": logs, "killed": killed}


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    ray.init(_node_ip_address=os.environ["RINGTRAIN_TEST_NODE_IP"], logging_level="WARNING")
    if mode == "trainer":
        result = run_trainer(out_dir, own_group=False)
    elif mode == "trainer-torch":
        result = run_trainer(out_dir, own_group=True)
    elif mode == "executor":
        result = run_executor(out_dir)
    elif mode == "elastic":
        result = run_elastic(out_dir)
    elif mode == "elastic-grow":
        result = run_elastic_grow(out_dir)
    elif mode == "raytrain-restart":
        result = run_raytrain_restart(out_dir)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("RESULT " + json.dumps(result), flush=True)
    if mode == "raytrain-restart":
        os._exit(0)  # not waiting for Ray Train's finalization (see run_raytrain_restart)


if __name__ == "__main__":
    main()

"""What a user's type checker sees of the public API; `make lint` runs mypy on this file.

Never run. Each line must type-check as written; the lines marked ``type: ignore[arg-type]`` must
be errors (mypy's ``warn_unused_ignores`` fails the lint if an argument's type is loosened).
"""

from __future__ import annotations

import torch

import ringtrain
import ringtrain.torch as hvd


def usage(t: torch.Tensor, model: torch.nn.Module) -> None:
    a: torch.Tensor = hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16)
    b: torch.Tensor = hvd.synchronize(hvd.allreduce_async(t, op="sum", compression="fp16"))
    c: list[torch.Tensor] = hvd.synchronize(hvd.grouped_allreduce_async([a, b]))
    d: list[torch.Tensor] = ringtrain.grouped_allreduce(c, op=ringtrain.Average)
    e: torch.Tensor = hvd.synchronize(hvd.broadcast_async(d[0], root_rank=0))
    f: tuple[torch.Tensor, torch.Tensor] = hvd.synchronize(hvd.alltoall_async(e))
    g: torch.Tensor = hvd.reducescatter(f[0], compression=hvd.Compression.powersgd())
    h: list[int] = hvd.allgather_object(hvd.rank())
    i: dict[str, int] = hvd.broadcast_object({"step": h[0]})
    j: int = hvd.join()
    k: bool = hvd.poll(hvd.allgather_async(g)) and hvd.is_initialized()
    hvd.broadcast_parameters(model.state_dict(), root_rank=i["step"] + j + int(k))
    # The blocking spellings made from their non-blocking twins keep the twins' parameters.
    m: torch.Tensor = hvd.allreduce_(t, op=hvd.Sum, process_set=hvd.global_process_set)
    n: list[torch.Tensor] = hvd.grouped_allgather([m], name="gathered")
    o: torch.Tensor = hvd.broadcast_(hvd.broadcast(n[0], root_rank=0), 0, name="bcast")
    p: list[torch.Tensor] = hvd.grouped_allreduce_([o], average=False, prescale_factor=0.5)
    q: torch.Tensor = hvd.allgather(p[0], "name", hvd.global_process_set)
    hvd.broadcast_(q, root_rank=0, nmae="typo")  # type: ignore[call-arg]
    hvd.allgather(t, process_set=1)  # type: ignore[arg-type]
    hvd.allreduce_(t, compression=hvd.Compression.fp16)  # type: ignore[call-arg]
    hvd.allreduce(t, op=1)  # Horovod's number for Sum
    hvd.allreduce(t, op=1.0)  # type: ignore[arg-type]
    hvd.allreduce(t, compression=0.5)  # type: ignore[arg-type]
    hvd.grouped_allreduce_async([t], op=hvd.Sum, compression=torch.float16)  # type: ignore[arg-type]


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """DistributedOptimizer takes what the collectives take for compression= and op=."""
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    hvd.DistributedOptimizer(sgd, compression=hvd.Compression.fp16, op=hvd.Average)
    hvd.DistributedOptimizer(sgd, compression="powersgd", op="sum")
    hvd.DistributedOptimizer(sgd, compression=hvd.Compression.powersgd(), op=hvd.Sum)
    hvd.DistributedOptimizer(sgd, compression=0.5)  # type: ignore[arg-type]
    return hvd.DistributedOptimizer(sgd, op=1.0)  # type: ignore[arg-type]

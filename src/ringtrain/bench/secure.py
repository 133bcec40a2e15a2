"""Secure-mode benchmark: what sealing costs, as allreduce bus bandwidth vs message size.

Four implementations, all summing float32 zeros in place, on the same processes:

* ``gloo``: ``torch.distributed.all_reduce`` on a plain Gloo group (the floor under everything);
* ``ringtrain``: ``ringtrain.allreduce_`` in plain mode (negotiation, then Gloo);
* ``ringtrain-secure``: the same in secure mode (negotiation and data on sealed groups, every
  byte AES-256-GCM sealed on the wire);
* ``sealed``: ``torch.distributed.all_reduce`` on a ``ringtrain_sealed`` group: the sealed ring
  alone, as torch DDP or ringtrain's gradient engine see it.

Secure mode is a property of a whole ``ringtrain.init``, so plain and secure cannot share one
initialization: each repeat runs one *phase* per mode (``shutdown``, then ``init`` in that mode,
then every size), with the order of the two phases swapped every other repeat and the cases
within a phase alternating too. So both modes see the same machine load over the run, which a
shared machine needs; the price is two ``init`` cycles per repeat (their times are reported:
the secure one includes the authenticated rendezvous). Every case gets one untimed op per phase
first (its groups are new), each sample starts after a barrier, and a sample's time is the
slowest rank's. Bus bandwidth is ``2(n-1)/n * bytes / time``, comparable with a link's rate.

Keys: under ``ringtrain run --secure`` the launcher's key (``RINGTRAIN_KEY_FD``) serves every
secure phase; with ranks spawned here, :func:`spawned_key_file` makes a throwaway key file.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import ringtrain
from ringtrain import environ
from ringtrain.bench import catalog
from ringtrain.bench.allreduce import SizePoint
from ringtrain.bench.registry import register
from ringtrain.bench.stats import Summary, bus_bandwidth, load_average, machine_info
from ringtrain.bench.timing import seconds_per_op
from ringtrain.bench.units import MiB
from ringtrain.config import env_var
from ringtrain.runtime import state
from ringtrain.security import keys

DEFAULT_SIZES = catalog.SECURE_SIZES
MODES = ("plain", "secure")
IMPLS = {"plain": ("gloo", "ringtrain"), "secure": ("ringtrain-secure", "sealed")}
# Auto iteration count: about this many bytes per sample (small sizes are not all timer noise).
SAMPLE_BYTES = 8 * MiB
MAX_ITERS = 50


@dataclass(frozen=True)
class SecureParams:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 5  # timed samples per size and implementation (= phases per mode)
    iters: int = 0  # ops per sample; 0 picks one per size
    link_mbps: float | None = None
    key_file: str = ""  # empty: the launcher's key, or RINGTRAIN_KEY_FILE


@dataclass
class SecureResult:
    world_size: int
    params: SecureParams
    sizes: list[SizePoint] = field(default_factory=list)
    # Seconds per ringtrain.init in each mode (secure: with the authenticated rendezvous).
    init_time: dict[str, Summary] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)

    def median(self, impl: str, nbytes: int) -> float:
        """Median bus bandwidth (B/s) of ``impl`` at ``nbytes``; 0.0 when not measured."""
        return next(
            (p.busbw.median for p in self.sizes if p.impl == impl and p.nbytes == nbytes), 0.0
        )


@contextlib.contextmanager
def spawned_key_file(params: SecureParams) -> Iterator[SecureParams]:
    """``params`` with a key for ranks spawned on this machine: a fresh job key in a private
    temporary file, removed afterwards. Unchanged when a key is already given (or launched)."""
    env = environ.current()
    if params.key_file or env.get(keys.KEY_FD_VAR) or env.get(env_var("key_file")):
        yield params
        return
    with tempfile.TemporaryDirectory(prefix="ringtrain-bench-key-") as tmp:
        path = keys.write_key_file(os.path.join(tmp, "job.key"), keys.generate_job_key())
        yield SecureParams(params.sizes, params.repeats, params.iters, params.link_mbps, path)


def _iters_for(nbytes: int, params: SecureParams) -> int:
    if params.iters > 0:
        return params.iters
    return max(1, min(MAX_ITERS, SAMPLE_BYTES // max(1, nbytes)))


def _switch(mode: str, base: Any, key_file: str) -> float:
    """Re-initialize ringtrain in ``mode``; returns the seconds ``init`` took."""
    ringtrain.shutdown()
    changes: dict[str, Any] = {"secure": mode == "secure"}
    if mode == "secure" and key_file:
        changes["key_file"] = key_file
    t0 = time.perf_counter()
    ringtrain.init(config=base.replace(**changes))
    return time.perf_counter() - t0


def _rt_allreduce(t: torch.Tensor, name: str) -> None:
    ringtrain.allreduce_(t, name=name, op=ringtrain.Sum)


def _cases(mode: str, t: torch.Tensor, name: str) -> dict[str, Callable[[], None]]:
    # The default group is plain Gloo in a plain phase and a ringtrain_sealed one in a secure one.
    raw = functools.partial(dist.all_reduce, t)
    rt = functools.partial(_rt_allreduce, t, f"{name}.{mode}")
    if mode == "plain":
        return {"gloo": raw, "ringtrain": rt}
    return {"ringtrain-secure": rt, "sealed": raw}


def _phase(
    mode: str, rep: int, params: SecureParams, buffers: dict[int, torch.Tensor]
) -> dict[tuple[str, int], float]:
    """One timed sample of each of ``mode``'s cases at every size: seconds per op, this rank."""
    out: dict[tuple[str, int], float] = {}
    for nbytes in params.sizes:
        cases = _cases(mode, buffers[nbytes], f"bench.secure.{nbytes}")
        iters = _iters_for(nbytes, params)
        for op in cases.values():
            op()  # warm-up: this phase's groups, names and buffers are new
        order = list(cases) if rep % 2 == 0 else list(cases)[::-1]
        for impl in order:
            out[(impl, nbytes)] = seconds_per_op(cases[impl], iters)
    return out


@register("secure")
def bench_secure(params: SecureParams) -> SecureResult:
    """Runs on every rank after ``ringtrain.init()``; every rank returns the same result.

    Switches between plain and secure mode (shutdown, init) and leaves ringtrain initialized in
    the mode of the last phase.
    """
    base = state.current().config
    n = ringtrain.size()
    environment = machine_info()
    buffers = {b: torch.zeros(max(1, b // 4), dtype=torch.float32) for b in params.sizes}
    local: dict[tuple[str, int], list[float]] = {}
    init_s: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(params.repeats):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            init_s[mode].append(_switch(mode, base, params.key_file))
            for key, seconds in _phase(mode, rep, params, buffers).items():
                local.setdefault(key, []).append(seconds)
    # The slowest rank's time, sample by sample (and init by init): one small allreduce.
    keys_ = sorted(local)
    flat = [s for k in keys_ for s in local[k]] + [s for m in MODES for s in init_s[m]]
    slowest = torch.tensor(flat, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    values = slowest.tolist()
    r = params.repeats
    result = SecureResult(n, params, environment=environment)
    for i, (impl, nbytes) in enumerate(keys_):
        samples = values[i * r : (i + 1) * r]
        busbw = [bus_bandwidth(4 * buffers[nbytes].numel(), s, n) for s in samples]
        result.sizes.append(
            SizePoint(
                impl,
                4 * buffers[nbytes].numel(),
                _iters_for(nbytes, params),
                Summary.of(samples),
                Summary.of(busbw),
            )
        )
    base_i = len(keys_) * r
    for j, mode in enumerate(MODES):
        result.init_time[mode] = Summary.of(values[base_i + j * r : base_i + (j + 1) * r])
    result.environment["load_after"] = load_average()
    return result

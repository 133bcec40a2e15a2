"""The engine settings of one DistributedOptimizer: its arguments over the job's Config.

Arguments left as None come from :class:`ringtrain.config.Config`; the ones given replace the
Config's through ``Config.replace``, so they are checked once, by the Config's own rules.

The engine's keyword arguments of ``DistributedOptimizer``:

fusion_threshold_bytes, cycle_time_ms, bucket_order: bucket planning (see
    :mod:`ringtrain.engine.buckets` for the tuning guide).
hierarchical: "auto", "on" or "off": reduce buckets hierarchically (within hosts, then
    across; world process set, plain and 16-bit buckets only).
engine_streams: process groups the buckets use round robin (world process set only).
reproducible: False lets timing shape the buckets (cuts at gaps in backward); see
    docs/engine.md, "Reproducibility".
link_class: "auto" (measured in the first step), "fast" or "slow": sets the bucket size.
shard_optimizer: True steps the optimizer sharded (ZeRO stage 1): each rank keeps and
    updates the optimizer state of 1/N of every bucket, then the updated parameters
    are all-gathered (:mod:`ringtrain.engine.sharded`). ``state_dict()`` then gathers
    the full state and is collective: every rank must call it.
reduce_scatter: with ``shard_optimizer``, reduce-scatter the gradients instead of
    allreducing them: each rank receives the sum of its own shard only, so a sharded
    step moves an allreduce's bytes in all, not 1.5 times them. Sums follow a ring's
    order (not the unsharded engine's, so weights differ from it in the last bits),
    and outside this rank's shard ``.grad`` keeps this rank's own gradient after
    ``step()``; ``synchronize()`` all-gathers the reduced gradients when you call it
    (to clip them, say). Combines with every codec, transport, ``overlap`` and
    ``hierarchical`` (docs/engine.md, "One gradient path"): a codec that cannot be cut
    (PowerSGD, top-k) and the hierarchical allreduce reduce whole buckets, and the
    sharded step takes its shard after.
overlap: True: ``step()`` returns once the buckets are launched, each bucket's parameters
    are updated as its reduction completes, and the next forward waits per module for
    its own parameters (:mod:`ringtrain.engine.overlap`; contract in docs/engine.md).
    Combines with ``shard_optimizer``: the all-gathers then overlap the next forward.
sync_every: local updates (DiLoCo, :mod:`ringtrain.engine.local_update`): each rank takes
    this many steps on its own gradients, exchanging nothing, then the averaged change of
    the weights takes one ``outer_optimizer`` step. 0 (default) trains synchronously;
    ``"auto"`` measures (with ``compression="auto"``) and picks local updates only where
    synchronous training cannot reach 80% efficiency. One number per rank (``[48, 16]``):
    rank r takes that many inner steps a round (a faster rank does more), and the outer
    average weighs each rank by the samples it took (steps times its ``batch_shares``).
outer_compression: the outer exchange's wire: "none", "fp16" (default), "bf16", "int8",
    "int4" (the narrow ones with error feedback).
outer_overlap: True: the outer exchange runs in the background during the next round's inner
    steps and its average is applied ``outer_delay`` inner steps later (streaming DiLoCo).
outer_fragments: local updates' parameters cut into this many fragments (1 to ``sync_every``),
    fragment ``f`` exchanged at inner step ``(f + 1) * sync_every // outer_fragments`` of each
    round (streaming DiLoCo); 1 (default): the whole model at the round's end.
outer_delay: with ``outer_overlap``, how many inner steps the exchange may take (1 to
    ``sync_every``); 0 (default): a quarter of the round, at least 1.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from ringtrain.collectives.reduce_ops import Sum, is_adasum, resolve_op
from ringtrain.compression import averaging
from ringtrain.config import Config
from ringtrain.engine import local_settings
from ringtrain.engine.weighting import Averaging, check_shares, weight_of
from ringtrain.errors import ConfigError
from ringtrain.runtime import queries

# DistributedOptimizer's keyword arguments that are Config fields of the same name.
CONFIG_ARGS = (
    "fusion_threshold_bytes",
    "cycle_time_ms",
    "bucket_order",
    "hierarchical",
    "engine_streams",
    "reproducible",
    "link_class",
    "shard_optimizer",
    "overlap",
    "reduce_scatter",
    "sync_every",
    "outer_compression",
    "outer_overlap",
    "outer_delay",
    "outer_fragments",
)


def check_passes(passes: int) -> None:
    """``backward_passes_per_step``, as the constructor and ``set_backward_passes_per_step``
    take it: one or more."""
    if passes < 1:
        raise ConfigError(f"backward_passes_per_step must be >= 1, got {passes}")


@dataclasses.dataclass(frozen=True)
class Reduction:
    """What the reduction makes of the sum: Horovod's ``op``, ``gradient_predivide_factor``,
    ``backward_passes_per_step`` with ``average_aggregated_gradients``, ``batch_shares``
    (a tuple of per-rank shares; ``"auto"`` until measured shares replace it)."""

    op: str
    predivide: float
    passes: int
    average_aggregated: bool
    shares: tuple[float, ...] | str | None = None

    @classmethod
    def of(
        cls,
        op: Any,
        predivide: float,
        passes: int,
        average_aggregated: bool,
        shares: object = None,
    ) -> Reduction:
        check_passes(passes)
        if predivide <= 0:
            raise ConfigError(f"gradient_predivide_factor must be > 0, got {predivide}")
        if is_adasum(op) and queries.size() == 1:
            # Horovod's factory returns its plain optimizer on one rank (Adasum of one gradient
            # is that gradient); on more, resolve_op raises its NotImplementedError.
            op = Sum
        name = resolve_op(op)
        if name not in ("Average", "Sum"):
            raise ConfigError(f"DistributedOptimizer supports op=Average or Sum, got {name}")
        if predivide != 1.0 and name != "Average":
            raise ConfigError("gradient_predivide_factor needs op=Average")
        checked = check_shares(shares)
        if checked is not None and name != "Average":
            raise ConfigError(
                f"batch_shares weighs each rank's gradient in an average, but op={name}.\n"
                "HINT: use op=Average (the default) with batch_shares."
            )
        return cls(name, predivide, passes, average_aggregated, checked)

    def averaging(self, size: int, passes: int, rank: int = 0) -> Averaging:
        """What this step's reduction asks for (:class:`ringtrain.engine.weighting.Averaging`,
        whose factors come from the one rule, :mod:`ringtrain.compression.averaging`) for
        ``size`` contributors, ``passes`` backward passes per step, and, with batch_shares,
        rank ``rank``'s weight (``"auto"`` before its first measurement: equal shares)."""
        k = passes if self.average_aggregated else 1
        fixed = self.shares if isinstance(self.shares, tuple) else None
        weight = weight_of(fixed, rank, size) if size > 1 else None
        return Averaging(self.op == "Average", size, self.predivide, 1.0 / k, weight)

    def local(self, params: list[torch.nn.Parameter], passes: int, size: int) -> None:
        """Nothing to reduce (one rank, or outside the process set); on one rank, averaging
        aggregated backward passes still divides by their number."""
        if size == 1 and self.average_aggregated and passes > 1:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        averaging.mean(p.grad, passes)


def check_groups(groups: object, num_groups: int) -> None:
    """Horovod's ``groups=``/``num_groups=``: checked as Horovod checks them (a ValueError),
    then ignored with a warning: the engine plans its buckets itself."""
    if groups is not None and not (
        isinstance(groups, list) or (isinstance(groups, int) and groups > 0)
    ):
        raise ConfigError(
            f"groups={groups!r}: groups should be a positive integer or a list of lists of "
            "torch.Tensor"
        )
    if isinstance(groups, list):
        seen: set[int] = set()
        for group in groups:
            members = group if isinstance(group, (list, tuple)) else [group]
            if not all(isinstance(p, torch.Tensor) for p in members):
                raise ConfigError(
                    "groups must consist of torch.Tensor (a list of lists of parameters); got "
                    f"a group {group!r:.80}"
                )
            for p in members:
                if id(p) in seen:
                    raise ConfigError("A parameter can only appear once in groups.")
                seen.add(id(p))
    if groups is not None or num_groups:
        warnings.warn(
            "DistributedOptimizer(groups=/num_groups=) is ignored: ringtrain plans buckets itself "
            "(see fusion_threshold_bytes, cycle_time_ms, bucket_order)",
            stacklevel=3,
        )


def resolve(config: Config, **args: Any) -> Config:
    """``config`` with the given (not None) arguments in place, validated by the Config."""
    changes = {k: v for k, v in args.items() if v is not None}
    if isinstance(changes.get("sync_every"), (list, tuple)):  # one per rank: the variable's form
        changes["sync_every"] = ",".join(str(v) for v in changes["sync_every"])
    unknown = sorted(set(changes) - set(CONFIG_ARGS))
    if unknown:
        raise ConfigError(f"not engine settings: {unknown}")
    if not changes:
        return config
    # log_level holds the resolved level name, which the Config's own check accepts again.
    return config.replace(**changes)


def check(config: Config, reduction: Reduction) -> Reduction:
    """The settings that do not combine, as errors that say what to change; the reduction with
    the Config's ``batch_shares`` (``RINGTRAIN_BATCH_SHARES``) where the argument was not given."""
    check_reduce_scatter(config)
    if reduction.shares is None and config.batch_shares:
        text = config.batch_shares
        given = text if text == "auto" else [float(v) for v in text.split(",")]
        reduction = Reduction.of(
            reduction.op, reduction.predivide, reduction.passes, reduction.average_aggregated, given
        )
    check_batch_shares(reduction, config)
    return reduction


def check_reduce_scatter(config: Config) -> None:
    """reduce_scatter=True: what it needs, as an error that says what to change."""
    if config.reduce_scatter and not config.shard_optimizer:
        raise ConfigError(
            "reduce_scatter=True needs shard_optimizer=True: each rank then steps only the "
            "shard whose sum it receives.\nHINT: add shard_optimizer=True, or drop "
            "reduce_scatter."
        )


def check_batch_shares(reduction: Reduction, config: Config) -> None:
    """batch_shares: what it does not combine with yet, as an error that says what to change."""
    if reduction.shares is None:
        return
    if reduction.shares == "auto" and config.overlap:
        raise ConfigError(
            "batch_shares='auto' agrees on new shares at a step boundary, which overlap=True "
            "does not have (the next forward starts while buckets are on the wire).\nHINT: "
            "give the shares (e.g. [3, 1]), or drop overlap."
        )
    every = local_settings.parse_sync_every(config.sync_every)
    if reduction.shares == "auto" and (every == "auto" or isinstance(every, tuple)):
        raise ConfigError(
            "batch_shares='auto' sets each rank's share of the samples from measured rates, "
            f"and sync_every={config.sync_every!r} would choose the rounds as well.\nHINT: give "
            "sync_every one number of steps (the shares then follow each rank's rate, measured "
            "a round at a time), or give the shares (e.g. [3, 1])."
        )

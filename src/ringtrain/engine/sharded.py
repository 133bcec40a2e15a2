"""The sharded optimizer step (ZeRO stage 1): each rank keeps and steps 1/N of the optimizer.

With ``DistributedOptimizer(shard_optimizer=True)`` (or ``RINGTRAIN_SHARD_OPTIMIZER=1``) the
gradients are exchanged exactly as without it (:mod:`ringtrain.engine.exchange`: per bucket,
during backward, same plan, same sums), so every ``.grad`` holds the reduced gradient and
clipping between ``synchronize()`` and ``step()`` works unchanged. What changes is the step:

1. Each bucket of the plan is cut into N equal *shards* of its flat layout (padded to a multiple
   of N); rank r owns shard r of every bucket.
2. A *piece* is the part of one parameter inside this rank's shard: a flat view of the
   parameter's own storage (and of its gradient). Each bucket gets one instance of the user's
   optimizer class over its pieces (torch's fused kernel where torch has one for the device),
   with the user's param groups' hyper-parameters copied in before every step, so LR
   schedulers keep working. So optimizer state (Adam's two moments) exists for 1/N of the
   elements on each rank, and each rank does 1/N of the optimizer's arithmetic.
3. Each bucket's updated shard is all-gathered, and every rank copies the other ranks' shards
   into its parameters: after ``step()`` every rank holds the same full weights. The gathers
   run in slices of at most :data:`GATHER_BYTES`, two in flight (the next slice travels while
   the last one is copied out, and bucket b's last slices while bucket b+1 steps), so their
   transient buffers stay a few MiB whatever the bucket size.
   With ``overlap=True`` (:mod:`ringtrain.engine.overlap`) the updater thread does this bucket
   by bucket (:meth:`ShardedStep.step_bucket`), in the overlap's launch order, as each bucket's
   reduction completes, while the next forward waits per module for its own bucket.

Why an allreduce and not a reduce-scatter: torch's Gloo backend implements
``reduce_scatter_tensor`` as a clone of the whole input, an allreduce of it, and a copy of the
rank's chunk (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), so a reduce-scatter would
cost the allreduce's traffic plus a bucket-sized copy. Keeping the engine's in-place allreduce
costs no more on the wire, keeps every ``.grad`` whole, and keeps the reduction order: the sums
are bit for bit the unsharded engine's. The all-gather is the extra traffic, (N-1)/N of the
parameters per rank and step. ``reduce_scatter=True`` trades those bits for an allreduce's bytes:
the exchange then reduce-scatters each bucket around a ring of its own, cut into exactly these
shards (:mod:`ringtrain.engine.exchange`), and each rank receives only the sums it steps.

Checkpoints: :meth:`ShardedStep.gather_state` (collective) rebuilds the full per-parameter state
in the wrapped optimizer's own layout, so ``state_dict()`` is interchangeable with the
unsharded mode's; :meth:`ShardedStep.load_state` takes this rank's pieces from a full state.
A state value is per element when it is a tensor shaped like its parameter (``step`` never is,
as in torch's own ``load_state_dict``); anything else (``step``) is per parameter and comes from
the rank that owns the parameter's first element.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ringtrain.engine.buckets import Plan
from ringtrain.errors import ConfigError
from ringtrain.runtime import abort
from ringtrain.transport import group_ops

# Group keys that belong to the shard optimizers themselves, never copied from the user's groups.
OWN_KEYS = frozenset({"params", "fused", "foreach"})
# Largest all-gather output: parameters come back in slices of this, so the transient buffers
# (ours and Gloo's own flat copy, two slices in flight) stay a few MiB whatever the bucket size.
GATHER_BYTES = 4 << 20


@dataclass(frozen=True)
class Piece:
    """The part ``[start, stop)`` of parameter ``index`` (flattened) that this rank steps."""

    index: int
    start: int
    stop: int
    group: int  # the user's param group the parameter belongs to


@dataclass(frozen=True)
class Layout:
    """Where this rank's shard of one bucket lies (elements of the bucket's flat layout)."""

    bucket: int
    numel: int  # the bucket's elements
    shard: int  # elements per rank (the bucket padded to a multiple of the ranks)
    pieces: tuple[Piece, ...]

    def bounds(self, rank: int) -> tuple[int, int]:
        return rank * self.shard, (rank + 1) * self.shard


# One all-gather slice in flight: (bucket layout, first and end element of the shard, output,
# work).
_Slice = tuple[Layout, int, int, torch.Tensor, Any]


def layouts(plan: Plan, group_of: Sequence[int], rank: int, size: int) -> list[Layout]:
    """This rank's pieces of every bucket of ``plan``: pure, the same cut on every rank."""
    out = []
    for b in plan.buckets:
        shard = -(-b.numel // size)
        lo, hi = rank * shard, (rank + 1) * shard
        pieces = []
        for i, offset, shape in zip(b.params, b.offsets, b.shapes):
            n = 1
            for d in shape:
                n *= d
            a, z = max(lo, offset), min(hi, offset + n)
            if a < z:
                pieces.append(Piece(i, a - offset, z - offset, group_of[i]))
        out.append(Layout(b.index, b.numel, shard, tuple(pieces)))
    return out


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`ConfigError` for optimizers that cannot step on flat pieces."""
    if isinstance(optimizer, (torch.optim.LBFGS, torch.optim.SparseAdam)):
        raise ConfigError(
            f"shard_optimizer=True cannot shard {type(optimizer).__name__}: it needs whole "
            "parameters (LBFGS) or sparse gradients (SparseAdam).\n"
            "HINT: use shard_optimizer=False with this optimizer."
        )


def _is_element_state(key: Any, value: Any, shape: torch.Size | tuple[int, ...]) -> bool:
    return key != "step" and isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(shape)


class ShardedStep:
    """This rank's share of the optimizer for one bucket plan (see the module docstring)."""

    def __init__(
        self,
        plan: Plan,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        optimizer: torch.optim.Optimizer,
        group: Any,
        rank: int,
        size: int,
    ) -> None:
        if plan.sparse:
            raise ConfigError(
                f"shard_optimizer=True needs dense gradients, but {names[plan.sparse[0]]!r} has "
                "a sparse one.\nHINT: pass sparse_as_dense=True, or shard_optimizer=False."
            )
        self.plan = plan
        self._params = list(params)
        self._names = list(names)
        self._user = optimizer
        self._group = group
        self._rank, self._size = rank, size
        group_of = [0] * len(self._params)
        where = {id(p): i for i, p in enumerate(self._params)}
        for g, pg in enumerate(optimizer.param_groups):
            for p in pg["params"]:
                group_of[where[id(p)]] = g
        self.layouts = layouts(plan, group_of, rank, size)
        for b in plan.buckets:
            for i in b.params:
                if not self._params[i].is_contiguous():
                    raise ConfigError(
                        f"shard_optimizer=True steps flat views of parameters, but "
                        f"{names[i]!r} is not contiguous (e.g. channels_last).\n"
                        "HINT: model.to(memory_format=torch.contiguous_format), or "
                        "shard_optimizer=False."
                    )
        # One optimizer per bucket, so bucket b's all-gather flies while bucket b+1 steps.
        self._tensors: list[list[torch.Tensor]] = []
        self._opts: list[torch.optim.Optimizer | None] = []
        for layout in self.layouts:
            views = [self._view(piece) for piece in layout.pieces]
            self._tensors.append(views)
            self._opts.append(self._make(layout, views) if views else None)

    # ---- building ------------------------------------------------------------------------------

    def _view(self, piece: Piece) -> torch.Tensor:
        return self._params[piece.index].detach().view(-1)[piece.start : piece.stop]

    def _make(self, layout: Layout, views: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The user's optimizer class over this bucket's pieces: one group per piece, so each
        piece takes its own parameter's group settings."""
        user = self._user
        cls = type(user)
        groups = []
        fused = self._use_fused(views[0])
        for piece, view in zip(layout.pieces, views):
            settings = {k: v for k, v in user.param_groups[piece.group].items() if k != "params"}
            if fused:
                settings["fused"], settings["foreach"] = True, None
            groups.append({**settings, "params": [view]})
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in user.defaults.items() if k in accepted and k != "params"}
        if fused:
            kwargs["fused"], kwargs["foreach"] = True, None
        try:
            return cls(groups, **kwargs)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ConfigError(
                f"shard_optimizer=True could not build {cls.__name__} over parameter shards: "
                f"{e}\nHINT: the optimizer class must accept (param_groups, **defaults), as "
                "torch.optim's do; or use shard_optimizer=False."
            ) from e

    def _use_fused(self, sample: torch.Tensor) -> bool:
        """torch's fused kernel, where the class has one for this device and the user left the
        implementation to torch (foreach and fused unset)."""
        d = self._user.defaults
        if "fused" not in d or d.get("fused") is not None or d.get("foreach") is not None:
            return False
        if d.get("differentiable") or not sample.is_floating_point():
            return False
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return sample.device.type in _get_fused_kernels_supported_devices()

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in self._opts if o is not None]

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors this rank holds."""
        total = 0
        for opt in self.optimizers:
            for st in opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        total += v.numel() * v.element_size()
        return total

    # ---- the step ------------------------------------------------------------------------------

    def hyper_parameters(self) -> list[dict[str, Any]]:
        """The user's param groups' settings as they are now. Overlap takes them at ``step()``
        and updates later, after an LR scheduler may have changed the user's groups."""
        return [
            {k: v for k, v in group.items() if k not in OWN_KEYS}
            for group in self._user.param_groups
        ]

    def step(self) -> None:
        """Step this rank's pieces, then all-gather every bucket into every rank's parameters,
        in slices of at most :data:`GATHER_BYTES` (two in flight, across buckets: bucket b's
        last slices travel while bucket b+1 steps)."""
        settings = self.hyper_parameters()
        n = len(self.layouts)
        self._pump(item for k in range(n) for item in self._step_and_gather(k, settings))

    def step_bucket(self, k: int, settings: list[dict[str, Any]], group: Any) -> None:
        """Step and all-gather bucket ``k`` alone, on ``group``: its parameters are final on
        return (overlap updates bucket by bucket, in its launch order, the same on every rank,
        on a group that only its updater thread uses)."""
        self._pump(self._step_and_gather(k, settings, group))

    def _pump(self, slices: Iterator[_Slice]) -> None:
        """Launch the slices in order, two in flight, landing each."""
        pending: list[_Slice] = []
        with torch.no_grad():
            for item in slices:
                pending.append(item)
                if len(pending) == 2:
                    self._land(*pending.pop(0))
            for item in pending:
                self._land(*item)

    def _step_and_gather(
        self, k: int, settings: list[dict[str, Any]], group: Any = None
    ) -> Iterator[_Slice]:
        """Step this rank's shard of bucket ``k``, then launch its all-gather slice by slice
        (on ``group``, default the engine group), one per ``next()``: the caller decides how
        many fly at once."""
        group = self._group if group is None else group
        layout, views, opt = self.layouts[k], self._tensors[k], self._opts[k]
        if opt is not None:
            self._refresh(layout, views, opt, settings)
            opt.step()
        mine = self._shard_of(layout, views)
        step = max(1, GATHER_BYTES // (self._size * mine.element_size()))
        for a in range(0, layout.shard, step):
            z = min(layout.shard, a + step)
            out = torch.empty((z - a) * self._size, dtype=mine.dtype, device=mine.device)
            work = group_ops.all_gather_into(out, mine[a:z], group, async_op=True)
            yield (layout, a, z, out, work)

    def _refresh(
        self,
        layout: Layout,
        views: list[torch.Tensor],
        opt: torch.optim.Optimizer,
        settings: list[dict[str, Any]],
    ) -> None:
        """Point every piece at its parameter's current storage and gradient, and take the
        user's hyper-parameters (``settings``: an LR scheduler changes the user's groups)."""
        for k, (piece, group) in enumerate(zip(layout.pieces, opt.param_groups)):
            p = self._params[piece.index]
            view = views[k]
            if view.data_ptr() != p.data_ptr() + piece.start * p.element_size():
                # The parameter got new storage (p.data = ...): follow it, keeping the state.
                fresh = self._view(piece)
                if view in opt.state:
                    opt.state[fresh] = opt.state.pop(view)
                views[k] = group["params"][0] = view = fresh
            g = p.grad
            if g is None:
                view.grad = torch.zeros_like(view)
            else:
                flat = g.view(-1) if g.is_contiguous() else g.reshape(-1)
                view.grad = flat[piece.start : piece.stop]
            group.update(settings[piece.group])

    def _shard_of(self, layout: Layout, views: list[torch.Tensor]) -> torch.Tensor:
        """This rank's shard of the bucket, contiguous (the all-gather's input)."""
        b = self.plan.buckets[layout.bucket]
        first = self._params[b.params[0]]
        mine = torch.zeros(layout.shard, dtype=first.dtype, device=first.device)
        lo = self._rank * layout.shard
        where = dict(zip(b.params, b.offsets))
        for piece, view in zip(layout.pieces, views):
            a = where[piece.index] + piece.start - lo
            mine[a : a + view.numel()].copy_(view)
            view.grad = None  # hold no reference to the gradient buffers between steps
        return mine

    def _land(self, layout: Layout, a: int, z: int, out: torch.Tensor, work: Any) -> None:
        """Copy the other ranks' slices ``[a, z)`` of their shards into the parameters."""
        abort.wait_work(work)
        b = self.plan.buckets[layout.bucket]
        w = z - a
        for r in range(self._size):
            if r == self._rank:
                continue  # stepped in place
            lo = r * layout.shard + a
            hi = lo + w
            src = out[r * w : (r + 1) * w]
            for i, offset, shape in zip(b.params, b.offsets, b.shapes):
                n = 1
                for d in shape:
                    n *= d
                s0, s1 = max(lo, offset), min(hi, offset + n)
                if s0 < s1:
                    dst = self._params[i].detach().view(-1)
                    dst[s0 - offset : s1 - offset].copy_(src[s0 - lo : s1 - lo])

    # ---- checkpoints ---------------------------------------------------------------------------

    def gather_state(self) -> dict[int, dict[str, Any]]:
        """Every parameter's full optimizer state, keyed by its position in the optimizer.
        Collective over the process set: every rank must call it (the same on every rank)."""
        # Per parameter, from the rank owning its first element: the per-parameter values, and
        # the names and dtypes of the per-element ones.
        mine: dict[int, tuple[dict[str, Any], dict[str, str]]] = {}
        for layout, views, opt in zip(self.layouts, self._tensors, self._opts):
            if opt is None:
                continue
            for piece, view in zip(layout.pieces, views):
                st = opt.state.get(view)
                if piece.start != 0 or not st:
                    continue
                scalars = {k: v for k, v in st.items() if not _is_element_state(k, v, view.shape)}
                tensors = {
                    k: str(v.dtype).replace("torch.", "")
                    for k, v in st.items()
                    if _is_element_state(k, v, view.shape)
                }
                mine[piece.index] = (scalars, tensors)
        every: list[Any] = [None] * self._size
        group_ops.all_gather_object(every, mine, self._group)
        info: dict[int, tuple[dict[str, Any], dict[str, str]]] = {}
        for part in every:
            info.update(part)
        full: dict[int, dict[str, Any]] = {i: dict(info[i][0]) for i in info}
        for layout, views, opt in zip(self.layouts, self._tensors, self._opts):
            b = self.plan.buckets[layout.bucket]
            keys: dict[str, str] = {}
            for i in b.params:
                if i in info:
                    keys.update(info[i][1])
            where = dict(zip(b.params, b.offsets))
            lo = self._rank * layout.shard
            first = self._params[b.params[0]]
            for key in sorted(keys):
                dtype = getattr(torch, keys[key])
                shard = torch.zeros(layout.shard, dtype=dtype, device=first.device)
                for piece, view in zip(layout.pieces, views):
                    st = opt.state.get(view) if opt is not None else None
                    value = st.get(key) if st else None
                    if isinstance(value, torch.Tensor):
                        a = where[piece.index] + piece.start - lo
                        shard[a : a + view.numel()].copy_(value.reshape(-1))
                out = torch.empty(layout.shard * self._size, dtype=dtype, device=first.device)
                group_ops.all_gather_into(out, shard, self._group)
                for i, offset, shape in zip(b.params, b.offsets, b.shapes):
                    if i in info and key in info[i][1]:
                        n = self._params[i].numel()
                        full[i][key] = out[offset : offset + n].view(shape).clone()
        return full

    def load_state(self, full: dict[int, dict[str, Any]]) -> None:
        """Take this rank's pieces of ``full`` (per parameter position, as :meth:`gather_state`
        gives), through each shard optimizer's own ``load_state_dict`` (so dtypes and devices
        follow torch's rules, e.g. ``step`` for fused kernels)."""
        for layout, opt in zip(self.layouts, self._opts):
            if opt is None:
                continue
            sd = opt.state_dict()
            state: dict[int, dict[str, Any]] = {}
            for j, piece in enumerate(layout.pieces):
                st = full.get(piece.index)
                if not st:
                    continue
                shape = self._params[piece.index].shape
                state[j] = {
                    k: (
                        v.detach().reshape(-1)[piece.start : piece.stop].clone()
                        if _is_element_state(k, v, shape)
                        else (v.clone() if isinstance(v, torch.Tensor) else v)
                    )
                    for k, v in st.items()
                }
            sd["state"] = state
            opt.load_state_dict(sd)

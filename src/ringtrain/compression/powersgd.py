"""PowerSGD: low-rank gradient compression with error feedback (Vogels et al., NeurIPS 2019).

A gradient matrix M (n x m) is sent as two thin factors: P = M Q (n x r) and Q = M^T P (m x r),
one step of power iteration per training step. Every rank sends (n + m) * r numbers instead of
n * m, so a 4096 x 4096 layer at rank 4 travels ~500x smaller. The reduction of one bucket is:

1. P = M Q on every rank; one allreduce carries P and, next to it, the tensors that are not
   worth compressing (1-D, small, or below ``min_compression_rate``), which are thereby
   averaged exactly; then P is orthogonalized (P^);
2. Q = M^T P^ on every rank, allreduce(Q) / world size; the bucket's average is P^ Q^T.

The two collectives are issued in this order, for every bucket, on every rank (a bucket with
nothing to factorize has only the first, with its plain tensors).
That is the whole difference from DDP's stock hook, whose second and third allreduces are
chained on completion callbacks and so can interleave differently across ranks when a step has
more than one bucket (Gloo then fails with "Received data size doesn't match expected size").

Tuning guide:

* ``matrix_approximation_rank`` (r): 1 is often enough for fine-tuning; 2-4 for training from
  scratch. Higher r is closer to exact but sends more and costs an r x r QR per matrix.
* ``start_iter``: plain allreduce for this many calls per bucket first. Early gradients change
  fast and low rank loses more there; 10 (DDP's default) to a few hundred are typical.
* ``min_compression_rate``: compress a matrix only if (n + m) * r * rate < n * m; smaller
  matrices are cheaper to send whole than to factor.
* ``warm_start``: start each step's power iteration from the last step's Q. Keeps quality at
  r = 1-2 at no cost; leave it on.
* ``error_feedback``: what compression loses on this rank is added to the next step's gradient,
  so nothing is lost for good, only delayed. Convergence without it is much worse; leave it on.

The error kept is the paper's local one, e = M_local - P^ (M_local^T P^)^T: its average over the
ranks is exactly what the bucket's result missed, so the sum of results over steps equals the
sum of true averages minus the (bounded) average of the last errors.

State (errors, warm-start Q, call counts) is per bucket key and comes back from
:meth:`PowerSGDReducer.state_dict`. Errors differ per rank: a checkpoint that must resume the
error feedback exactly saves every rank's state, not only rank 0's.

The reducer works on a FLAT bucket; it needs the shapes of the tensors packed in it, in order,
either from :meth:`PowerSGDReducer.plan` (once per bucket key) or per call via ``shapes=``.
Without shapes the whole bucket is treated as one near-square matrix (zero-padded), which still
compresses but mixes unrelated layers into one factorization.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ringtrain.compression import averaging
from ringtrain.compression.base import register
from ringtrain.compression.codec import Rounds
from ringtrain.errors import CollectiveArgumentError, ConfigError

log = logging.getLogger("ringtrain")

Shape = tuple[int, ...]


@dataclass(frozen=True)
class _MatrixGroup:
    """Same-shape matrices of a bucket, factorized together as one batch."""

    rows: int
    cols: int
    rank: int
    offsets: tuple[int, ...]  # element offsets of each matrix in the (padded) work buffer


@dataclass(frozen=True)
class FactorLayout:
    """How one bucket's flat buffer splits into compressed matrices and plain ranges."""

    numel: int  # length of the flat bucket
    padded: int  # length of the work buffer (>= numel; > only for the no-shapes fallback)
    matrices: tuple[_MatrixGroup, ...]
    plain: tuple[tuple[int, int], ...]  # (offset, numel) sent uncompressed

    @property
    def p_numel(self) -> int:
        return sum(len(g.offsets) * g.rows * g.rank for g in self.matrices)

    @property
    def q_numel(self) -> int:
        return sum(len(g.offsets) * g.cols * g.rank for g in self.matrices)

    @property
    def plain_numel(self) -> int:
        return sum(n for _, n in self.plain)

    @property
    def wire_numel(self) -> int:
        """Numbers each rank sends per step once compression is on."""
        return self.plain_numel + self.p_numel + self.q_numel


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """The paper's rule: factor only when the factors are ``min_compression_rate`` times smaller."""
    return (rows + cols) * rank * min_compression_rate < rows * cols


def make_layout(
    shapes: Sequence[Sequence[int]] | None,
    numel: int,
    rank: int,
    min_compression_rate: float,
) -> FactorLayout:
    """Plan a bucket (pure). ``shapes=None`` treats the bucket as one near-square matrix."""
    if shapes is None:
        rows = max(1, math.isqrt(numel))
        cols = -(-numel // rows) if numel else 0
        r = min(rows, cols, rank)
        if numel and should_compress(rows, cols, r, min_compression_rate):
            return FactorLayout(numel, rows * cols, (_MatrixGroup(rows, cols, r, (0,)),), ())
        return FactorLayout(numel, numel, (), ((0, numel),) if numel else ())
    by_shape: dict[tuple[int, int], list[int]] = {}
    plain: list[tuple[int, int]] = []
    offset = 0
    for shape in shapes:
        size = math.prod(shape)
        if len(shape) >= 2 and size > 0:
            rows, cols = shape[0], size // shape[0]
            if should_compress(rows, cols, min(rows, cols, rank), min_compression_rate):
                by_shape.setdefault((rows, cols), []).append(offset)
                offset += size
                continue
        if size:
            # Merge neighbouring plain ranges: fewer, larger copies.
            if plain and plain[-1][0] + plain[-1][1] == offset:
                plain[-1] = (plain[-1][0], plain[-1][1] + size)
            else:
                plain.append((offset, size))
        offset += size
    if offset != numel:
        raise CollectiveArgumentError(
            f"PowerSGD was given shapes totalling {offset} elements for a bucket of {numel}.\n"
            "HINT: pass the shapes of the tensors packed in this bucket, in packing order."
        )
    groups = tuple(
        _MatrixGroup(rows, cols, min(rows, cols, rank), tuple(offs))
        for (rows, cols), offs in by_shape.items()
    )
    return FactorLayout(numel, numel, groups, tuple(plain))


def orthogonalize(matrices: torch.Tensor, epsilon: float = 1e-8) -> torch.Tensor:
    """Orthonormal columns for a batch (b, k, r), k >= r, in place; fp32 or wider.

    Rank 1 is a normalisation (epsilon guards all-zero gradients); wider uses Householder QR,
    which stays orthonormal even when the columns are (nearly) dependent, where Gram-Schmidt
    would turn round-off into spurious directions.
    """
    if matrices.shape[-1] == 1:
        matrices /= torch.linalg.vector_norm(matrices, dim=1, keepdim=True) + epsilon
    else:
        matrices.copy_(torch.linalg.qr(matrices, mode="reduced").Q)
    return matrices


@dataclass
class _BucketState:
    layout: FactorLayout
    signature: Any
    calls: int = 0
    error: torch.Tensor | None = None  # work-buffer sized; zero outside the matrices
    qs: list[torch.Tensor] = field(default_factory=list)  # one (b, m, r) per matrix group


class PowerSGDReducer:
    """Averages flat gradient buckets across a process group with PowerSGD compression.

    A codec with rounds of its own (:class:`ringtrain.compression.codec.RoundsCodec`):
    ``reduce(bucket_key, flat, rounds)`` returns the average of ``flat`` over the ranks of
    ``rounds`` (a new tensor; ``flat`` is not modified), plus ``state_dict``/``load_state_dict``. Every rank must call ``reduce`` for the same bucket keys in
    the same order with same-sized buckets. See the module docstring for the tuning guide.
    """

    name = "powersgd"
    own_rounds = True

    def __init__(
        self,
        matrix_approximation_rank: int = 2,  # Config.powersgd_rank's default: one default
        start_iter: int = 10,  # Config.powersgd_start_step's
        min_compression_rate: float = 2.0,
        warm_start: bool = True,
        error_feedback: bool = True,
        orthogonalization_epsilon: float = 1e-8,
        seed: int = 0,
    ) -> None:
        if matrix_approximation_rank < 1:
            raise ConfigError(
                f"PowerSGD matrix_approximation_rank must be >= 1, got {matrix_approximation_rank}"
                "\nHINT: 1 for fine-tuning, 2-4 for training from scratch."
            )
        if start_iter < 0:
            raise ConfigError(f"PowerSGD start_iter must be >= 0, got {start_iter}")
        if min_compression_rate < 0 or orthogonalization_epsilon < 0:
            raise ConfigError(
                "PowerSGD min_compression_rate and orthogonalization_epsilon must be >= 0, got "
                f"{min_compression_rate} and {orthogonalization_epsilon}"
            )
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.warm_start = warm_start
        self.error_feedback = error_feedback
        self.epsilon = orthogonalization_epsilon
        self.seed = seed
        self._planned: dict[str, tuple[Shape, ...]] = {}
        self._buckets: dict[str, _BucketState] = {}
        self._loaded: dict[str, dict[str, Any]] = {}
        self.numel_in = 0  # elements reduced, and elements sent, since construction
        self.numel_sent = 0

    @classmethod
    def from_config(cls, config: Any) -> PowerSGDReducer:
        """Built from ``Config.powersgd_rank`` and ``Config.powersgd_start_step``."""
        return cls(
            matrix_approximation_rank=config.powersgd_rank, start_iter=config.powersgd_start_step
        )

    # -- planning -------------------------------------------------------------------------------

    def plan(self, bucket_key: str, shapes: Sequence[Sequence[int]]) -> None:
        """Declare the shapes packed (in order) in bucket ``bucket_key``; call before ``reduce``."""
        self._planned[bucket_key] = tuple(tuple(int(d) for d in s) for s in shapes)

    def layout(self, bucket_key: str) -> FactorLayout | None:
        """The current plan of a bucket that has been reduced at least once."""
        st = self._buckets.get(bucket_key)
        return st.layout if st else None

    def _state(self, key: str, flat: torch.Tensor, shapes: Any) -> _BucketState:
        if shapes is not None:
            shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        else:
            shapes = self._planned.get(key)
        signature = (flat.numel(), shapes, self.matrix_approximation_rank)
        st = self._buckets.get(key)
        if st is not None and st.signature == signature:
            return st
        if st is not None:
            log.info("PowerSGD: bucket %r changed shape; its error and warm start are reset", key)
        layout = make_layout(
            shapes, flat.numel(), self.matrix_approximation_rank, self.min_compression_rate
        )
        st = _BucketState(layout, signature)
        saved = self._loaded.pop(key, None)
        if saved is not None and saved.get("signature") == _plain(signature):
            st.calls = int(saved["calls"])
            if saved.get("error") is not None:
                # A copy: the error is updated in place, the caller's state must not change.
                st.error = saved["error"].to(flat.device, copy=True)
            st.qs = [q.to(flat.device) for q in saved.get("qs", [])]
        elif saved is not None:
            log.warning("PowerSGD: saved state of bucket %r does not match its layout; reset", key)
        self._buckets[key] = st
        return st

    # -- the reduction --------------------------------------------------------------------------

    def reduce(
        self,
        bucket_key: str,
        flat: torch.Tensor,
        rounds: Rounds,
        shapes: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """The average of ``flat`` over the ranks of ``rounds`` (PowerSGD-compressed once warmed
        up)."""
        if flat.dim() != 1 or not flat.is_floating_point():
            raise CollectiveArgumentError(
                f"PowerSGD reduces flat floating-point buckets, got a {flat.dim()}-D "
                f"{flat.dtype} tensor.\nHINT: flatten the bucket; integer tensors need no "
                "compression."
            )
        st = self._state(bucket_key, flat, shapes)
        world = rounds.size
        st.calls += 1
        self.numel_in += flat.numel()
        if st.calls <= self.start_iter:
            out = flat.detach().clone()
            rounds.allreduce(out).wait()
            self.numel_sent += flat.numel()
            return averaging.mean(out, world)
        lay = st.layout
        self.numel_sent += lay.wire_numel
        numel = lay.numel
        work_dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
        # x: the bucket plus the error carried over. It turns into this step's error in place,
        # so the result is the only bucket-sized buffer a step allocates (CPU allocations of
        # that size come back as fresh pages, whose first touch costs as much as a copy).
        x = st.error if self.error_feedback else None
        st.error = None  # rewritten below; never half-updated under the old name
        if x is None:
            x = torch.zeros(lay.padded, dtype=work_dtype, device=flat.device)
            x[:numel] = flat.detach()
        else:
            x = x.to(work_dtype)
            x[:numel] += flat.detach()
        out = torch.empty(lay.padded, dtype=work_dtype, device=flat.device)

        # Tensors sent whole travel in the first allreduce, ahead of P: one collective less
        # per bucket. They are divided by the world size first and summed in the work dtype,
        # so 16-bit buckets cannot overflow in the sum.
        first = torch.empty(lay.plain_numel + lay.p_numel, dtype=work_dtype, device=flat.device)
        if lay.plain:
            plain = first[: lay.plain_numel]
            averaging.mean(torch.cat([x[o : o + n] for o, n in lay.plain], out=plain), world)
        if lay.matrices:
            self._reduce_matrices(bucket_key, st, lay, x, out, first, world, rounds)
        else:
            rounds.allreduce(first).wait()
        pos = 0
        for o, n in lay.plain:
            out[o : o + n] = first[pos : pos + n]
            pos += n
        return out[:numel].to(flat.dtype)

    def _reduce_matrices(
        self,
        key: str,
        st: _BucketState,
        lay: FactorLayout,
        x: torch.Tensor,
        out: torch.Tensor,
        first: torch.Tensor,
        world: int,
        rounds: Rounds,
    ) -> None:
        """Both steps for the bucket's matrices; writes their averages into ``out``. P goes
        into ``first`` behind the plain tensors already there, and is allreduced with them.

        Q is held transposed, (b, r, m) row-major: BLAS computes M Q several times faster as
        M (Q^T)^T than with a column-thin Q, and Q^T = P^T M likewise. Each matrix is a view of
        ``x``, used where it lies: nothing is stacked or copied out.
        """
        ms = [[_matrix(x, g, o) for o in g.offsets] for g in lay.matrices]
        qts = self._initial_qts(key, st, lay, x)

        # 1. P = M Q, summed over ranks, orthogonalized (its scale does not matter).
        ps = _split(
            first[lay.plain_numel :], [(len(g.offsets), g.rows, g.rank) for g in lay.matrices]
        )
        for mats, p, qt in zip(ms, ps, qts, strict=True):
            for j, m in enumerate(mats):
                torch.mm(m, qt[j].t(), out=p[j])
        rounds.allreduce(first).wait()
        for p in ps:
            orthogonalize(p, self.epsilon)

        # 2. Q = M^T P^, averaged; result P^ Q^T. Local error uses the local Q (paper, Alg. 2).
        q_flat = torch.empty(lay.q_numel, dtype=x.dtype, device=x.device)
        local = _split(q_flat, [(len(g.offsets), g.rank, g.cols) for g in lay.matrices])
        for mats, p, qt in zip(ms, ps, local, strict=True):
            for j, m in enumerate(mats):
                torch.mm(p[j].t(), m, out=qt[j])
        q_sum = q_flat.clone() if self.error_feedback else q_flat
        q_work = rounds.allreduce(q_sum)
        if self.error_feedback:
            # While Q travels: x becomes e = M - P^ (M^T P^)^T, in place; plain ranges were
            # sent exactly, so nothing carries over there.
            for mats, p, qt in zip(ms, ps, local, strict=True):
                for j, m in enumerate(mats):
                    m.addmm_(p[j], qt[j], alpha=-1.0)
            for o, n in lay.plain:
                x[o : o + n] = 0
            st.error = x
        q_work.wait()
        averaging.mean(q_sum, world)
        avg = _split(q_sum, [(len(g.offsets), g.rank, g.cols) for g in lay.matrices])
        for g, p, qt in zip(lay.matrices, ps, avg, strict=True):
            for j, o in enumerate(g.offsets):
                torch.mm(p[j], qt[j], out=_matrix(out, g, o))
        # Kept as (b, m, r) views, the shape state_dict() has always saved.
        st.qs = [qt.transpose(1, 2) for qt in avg] if self.warm_start else []

    def _initial_qts(
        self, key: str, st: _BucketState, lay: FactorLayout, x: torch.Tensor
    ) -> list[torch.Tensor]:
        """Each group's starting Q^T, (b, r, m) contiguous: last step's Q or a seeded one."""
        shapes = [(len(g.offsets), g.cols, g.rank) for g in lay.matrices]
        if self.warm_start and [tuple(q.shape) for q in st.qs] == shapes:
            qs = [orthogonalize(q.to(x.dtype, copy=True), self.epsilon) for q in st.qs]
        else:
            # Same numbers on every rank without communication: seeded by (seed, bucket, call).
            gen = torch.Generator(device="cpu")
            gen.manual_seed(
                (self.seed * 1_000_003 + zlib.crc32(key.encode()) * 7919 + st.calls) % (2**63)
            )
            qs = [
                orthogonalize(
                    torch.randn(s, generator=gen, dtype=x.dtype).to(x.device), self.epsilon
                )
                for s in shapes
            ]
        return [q.transpose(1, 2).contiguous() for q in qs]

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Per-bucket call counts, error feedback and warm-start Q (this rank's)."""
        buckets: dict[str, Any] = dict(self._loaded)
        for key, st in self._buckets.items():
            buckets[key] = {
                "signature": _plain(st.signature),
                "calls": st.calls,
                "error": None if st.error is None else st.error.detach().clone(),
                "qs": [q.detach().clone() for q in st.qs],
            }
        return {"name": self.name, "version": 1, "buckets": buckets}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; applied to each bucket at its next ``reduce``."""
        if state.get("name", self.name) != self.name or state.get("version") != 1:
            raise ConfigError(
                f"this is not a PowerSGD v1 state (name={state.get('name')!r}, "
                f"version={state.get('version')!r}).\nHINT: resume with the compression the "
                "checkpoint was written with."
            )
        self._buckets.clear()
        self._loaded = {k: dict(v) for k, v in state["buckets"].items()}

    def stats(self) -> dict[str, float]:
        """Elements reduced and sent since construction, and their ratio."""
        ratio = self.numel_in / self.numel_sent if self.numel_sent else 1.0
        return {"numel_in": self.numel_in, "numel_sent": self.numel_sent, "ratio": ratio}


def _plain(signature: Any) -> Any:
    """A signature as plain lists, as it survives torch.save/load and comparison."""
    numel, shapes, rank = signature
    return [numel, None if shapes is None else [list(s) for s in shapes], rank]


def _matrix(buffer: torch.Tensor, g: _MatrixGroup, offset: int) -> torch.Tensor:
    """The (rows, cols) view of one matrix of group ``g`` in a work buffer."""
    return buffer[offset : offset + g.rows * g.cols].view(g.rows, g.cols)


def _split(flat: torch.Tensor, shapes: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    out, pos = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(flat[pos : pos + n].view(s))
        pos += n
    return out


register("powersgd", PowerSGDReducer)

"""What a rank submits for a collective, and the cross-rank consistency check.

A :class:`Request` is the small, picklable description of one submitted collective (never the
tensor itself); the controller exchanges them between ranks each cycle. :func:`mismatch` is a pure
function over the requests every rank made under one name: it returns the error every rank will
raise, listing what each rank submitted.

The check runs once per collective on every rank, so its happy path is one equality test per
rank (ranks that agree submit equal requests) and the field-by-field comparison and the message
are built only when something differs; ``ringtrain bench checks`` measures what it costs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar, cast

KINDS = ("allreduce", "allgather", "broadcast", "reducescatter", "alltoall", "barrier", "join")


class TensorMeta(NamedTuple):
    """Shape, dtype and device of one tensor. A named tuple, not a dataclass: requests are
    compared and hashed once per collective, and tuples do that in C (a grouped request may
    hold hundreds of these)."""

    shape: tuple[int, ...]
    dtype: str
    device: str = "cpu"

    def __str__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        where = "" if self.device == "cpu" else f"@{self.device}"
        return f"{self.dtype.replace('torch.', '')}[{dims}]{where}"


T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Request:
    """One collective as submitted by one rank.

    Equal requests are often one object (the controller's request cache hands out the cached
    one), and a cached request is looked up, compared and checked every time it runs: so
    equality starts with identity, the hash is worked out once, and :meth:`derived` keeps what
    else is worked out from a request. None of that travels in a pickle (string hashes differ
    between processes)."""

    name: str
    kind: str
    tensors: tuple[TensorMeta, ...] = ()
    op: str = ""
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    # alltoall: rows this rank sends to each peer; its receive splits come from the peers'.
    splits: tuple[int, ...] = ()
    # broadcast of objects: receivers do not know the shape, the root's request decides it.
    shape_from_root: bool = False
    # An error the submitting rank already found; every rank raises it when the name is ready.
    error: str = ""
    extra: tuple[tuple[str, str], ...] = field(default=())

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Request):
            return NotImplemented
        # Spelt out as dataclass's own __eq__ is: a call per side would double its cost.
        return (
            self.name,
            self.kind,
            self.tensors,
            self.op,
            self.root,
            self.prescale,
            self.postscale,
            self.splits,
            self.shape_from_root,
            self.error,
            self.extra,
        ) == (
            other.name,
            other.kind,
            other.tensors,
            other.op,
            other.root,
            other.prescale,
            other.postscale,
            other.splits,
            other.shape_from_root,
            other.error,
            other.extra,
        )

    def __hash__(self) -> int:
        known: int | None = self.__dict__.get("_hash")
        if known is None:
            known = self.__dict__["_hash"] = hash(_fields_of(self))
        return known

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k not in _WORKED_OUT}

    def derived(self, key: str, compute: Callable[[Request], T]) -> T:
        """``compute(self)``, worked out once per request object under ``key``."""
        memo: dict[str, object] = self.__dict__.setdefault("_derived", {})
        if key not in memo:
            memo[key] = compute(self)
        return cast(T, memo[key])

    def describe(self) -> str:
        args: list[str] = []
        if self.op:
            args.append(f"op={self.op}")
        if self.root >= 0:
            args.append(f"root_rank={self.root}")
        if self.prescale != 1.0:
            args.append(f"prescale_factor={self.prescale:g}")
        if self.postscale != 1.0:
            args.append(f"postscale_factor={self.postscale:g}")
        if self.splits:
            args.append(f"splits={list(self.splits)}")
        args += [str(t) for t in self.tensors] if not self.shape_from_root else ["<object>"]
        return f"{self.kind}({', '.join(args)})"


def _fields_of(r: Request) -> tuple[object, ...]:
    """Every field (Request.__eq__ spells them out too; a test checks both against the
    dataclass's fields)."""
    return (
        r.name,
        r.kind,
        r.tensors,
        r.op,
        r.root,
        r.prescale,
        r.postscale,
        r.splits,
        r.shape_from_root,
        r.error,
        r.extra,
    )


_WORKED_OUT = ("_hash", "_derived")  # see Request


class Alike(Mapping[int, Request]):
    """``set rank -> request`` for a request every rank made alike (a cache hit): O(1) in the
    rank count, where a dict would be built rank by rank."""

    def __init__(self, request: Request, size: int) -> None:
        self.request = request
        self._size = size

    def __getitem__(self, rank: int) -> Request:
        if not 0 <= rank < self._size:
            raise KeyError(rank)
        return self.request

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._size))

    def __len__(self) -> int:
        return self._size


def lowest(by_rank: Mapping[int, Request]) -> Request:
    """The request of the lowest set rank that submitted (O(1) for :class:`Alike`)."""
    if type(by_rank) is Alike:  # not isinstance: an ABC's check costs more than the rest
        return by_rank.request
    return by_rank[min(by_rank)]


def _first_difference(reqs: list[Request]) -> str | None:
    a = reqs[0]
    for b in reqs[1:]:
        if a.kind != b.kind:
            return "operation"
        if a.op != b.op:
            return "reduce op"
        if a.root != b.root:
            return "root rank"
        if (a.prescale, a.postscale) != (b.prescale, b.postscale):
            return "scale factor"
        if len(a.tensors) != len(b.tensors):
            return "number of tensors"
        for ta, tb in zip(a.tensors, b.tensors):
            if ta.dtype != tb.dtype:
                return "dtype"
            if ta.device.split(":")[0] != tb.device.split(":")[0]:
                return "device type"
            if a.kind in ("allgather", "alltoall"):
                if len(ta.shape) != len(tb.shape) or ta.shape[1:] != tb.shape[1:]:
                    return "shape (all dimensions but the first must agree)"
            elif a.kind == "broadcast" and (a.shape_from_root or b.shape_from_root):
                continue
            elif ta.shape != tb.shape:
                return "shape"
    return None


def mismatch(
    name: str, by_rank: Mapping[int, Request], set_ranks: Sequence[int] | None = None
) -> str | None:
    """The error to raise on every rank when the ranks' requests for ``name`` disagree, else None.

    ``by_rank`` is keyed by rank within the process set; ``set_ranks`` (the set's global ranks,
    default: the world) names them by global rank in the message, as users know them."""
    # The happy path: every rank submitted an equal request (often the very same object, when
    # it came from the controller's request cache) and none found an error.
    values = iter(by_rank.values())
    ref = next(values)
    if not ref.error and all(r is ref or r == ref for r in values):
        return None
    ranks = sorted(by_rank)
    errors = {r: by_rank[r].error for r in ranks if by_rank[r].error}
    if errors:
        # Every rank that found the first rank's error: one root outside the set passed by all
        # ranks is not a branch on the lowest of them.
        first = errors[min(errors)]
        alike = [r for r in ranks if errors.get(r) == first]
        who = [set_ranks[r] for r in alike] if set_ranks is not None else alike
        return f"collective {name!r} was invalid on {_rank_list(who)}: {first}"
    what = _first_difference([by_rank[r] for r in ranks])
    if what is None:
        return None
    lines = [f"ranks submitted collective {name!r} with different arguments ({what} differs):"]
    groups: dict[str, list[int]] = {}
    for r in ranks:
        groups.setdefault(by_rank[r].describe(), []).append(r)
    for desc, members in groups.items():
        if set_ranks is not None:
            members = [set_ranks[r] for r in members]
        lines.append(f"  {_rank_list(members)}: {desc}")
    lines.append(
        "HINT: every rank must call a named collective with the same operation, reduce op, root, "
        "dtype and shape; look for data-dependent shapes or a branch taken on some ranks only."
    )
    return "\n".join(lines)


def _rank_list(ranks: list[int]) -> str:
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


def local_errors(name: str, by_rank: dict[int, Request]) -> str | None:
    """With consistency checks off, still honour errors a rank found locally."""
    errs = [r.error for r in by_rank.values() if r.error]
    return f"collective {name!r} was invalid: {errs[0]}" if errs else None

"""The engine asks no dtype and no group what it is (issue 42): how bytes travel is the codec's
and the transport's.

Which wire a bucket takes, whether it is cast, cut, or redone in full precision, is decided by
the codec (:class:`ringtrain.compression.codec.Wire`: ``encode``, ``decode_into``, the declared
``redo_in_full``), so a 16-bit fix lives in ``compression/``; which collectives carry it, by the
stream's transport (``transport.of(group, hierarchical)``: Gloo, NCCL, the sealed and tcp
groups, the hierarchical allreduce), so the exchange sends to one door. The rules this test
reads from the source of every module under ``engine/``, in every condition (``if``, ``elif``,
``while``, ``assert``, ``x if c else y``, a comprehension's ``if``, a ``match`` guard):

* **no dtype branch**: no condition reads a dtype's identity or kind: a named dtype
  (``torch.float16``, ...), ``is_floating_point``/``is_complex``, ``finfo``/``iinfo``, a
  codec's ``wire_dtype`` or ``overflow.narrower``, an ``element_size()``/``itemsize`` compared
  as it is (byte offsets computed from it are fine), or a ``.dtype`` anywhere except in an
  (in)equality between dtypes. Comparing two tensors' dtypes (``a.dtype != b.dtype``) asks
  whether they are alike, not what they are: a bucket holds one dtype (``buckets.py``);
* **no group-kind branch**: no condition reads a group's backend (``backend``,
  ``get_backend``, the names ``"nccl"``, ``"gloo"``, ``"sealed"``, ``"tcp"``), its class
  (``RingProcessGroup``, ``ProcessGroup*``), or whether a stream is hierarchical
  (``hierarchical``, ``_hierarchical``).

The conditions left are listed with why: three are about the model, not the wire; three choose
or name a stream's kind where it is made or shown, never where a bucket is sent. A stale entry
fails too.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import ringtrain

ENGINE = Path(ringtrain.__file__).parent / "engine"

_KIND_NAMES = {"is_floating_point", "is_complex", "finfo", "iinfo", "wire_dtype", "narrower"}
_SIZES = {"element_size", "itemsize"}  # a dtype's kind where compared, not in an address
_DTYPES = {
    "float16", "half", "bfloat16", "float32", "float", "float64", "double", "complex64",
    "complex128", "uint8", "int8", "int16", "short", "int32", "int", "int64", "long", "bool",
}  # fmt: skip

_GROUP_NAMES = {"backend", "get_backend", "RingProcessGroup", "hierarchical", "_hierarchical"}
_GROUP_WORDS = {"nccl", "gloo", "sealed", "tcp", "ringtrain_sealed", "ringtrain_tcp"}

# (module, function): why the condition is not about how bytes travel.
ALLOWED = {
    ("sync_batch_norm.py", "_global_moments"): "the layer's statistics of 16-bit inputs are "
    "summed in float32 (the model's numerics)",
    ("local_update.py", "__init__"): "only floating parameters change, so only they train",
    ("sharded.py", "_use_fused"): "whether torch's fused optimizer kernel takes the dtype",
}
ALLOWED_GROUP_KINDS = {
    ("planner.py", "_make_routes"): "chooses the streams' kind from the settings, once per plan; "
    "the exchange gets each stream's transport (transport.of(group, hierarchical))",
    ("streams.py", "streams"): "makes the hierarchical allreduces the streams carry",
    ("exchange.py", "_record"): "the timeline names the bucket's path (a label, not a door)",
}


def _likeness(node: ast.AST) -> bool:
    """``a.dtype == b.dtype`` (or ``!=``, tuples of them): dtypes compared with each other."""
    if not isinstance(node, ast.Compare) or not all(
        isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops
    ):
        return False
    sides = [node.left, *node.comparators]
    return all(_reads_dtype_attr(s) for s in sides) and not any(_named(s) for s in sides)


def _reads_dtype_attr(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "dtype" for n in ast.walk(node))


def _named(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Attribute)
        and n.attr in _DTYPES
        and isinstance(n.value, ast.Name)
        and n.value.id == "torch"
        for n in ast.walk(node)
    )


def _size_of(node: ast.AST) -> bool:
    """``x.element_size()`` or ``x.itemsize`` itself."""
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Attribute) and node.attr in _SIZES


def _reads_a_dtype(test: ast.AST) -> bool:
    if _likeness(test):
        return False
    if isinstance(test, ast.Compare) and any(_size_of(s) for s in [test.left, *test.comparators]):
        return True
    for n in ast.iter_child_nodes(test):
        if _reads_a_dtype(n):
            return True
    if isinstance(test, ast.Attribute) and (test.attr in _KIND_NAMES or test.attr == "dtype"):
        return True
    if isinstance(test, ast.Name) and test.id in _KIND_NAMES:
        return True
    return _named(test) if isinstance(test, ast.Attribute) else False


def _reads_a_group_kind(test: ast.AST) -> bool:
    for n in ast.walk(test):
        if isinstance(n, ast.Attribute) and (
            n.attr in _GROUP_NAMES or n.attr.startswith("ProcessGroup")
        ):
            return True
        if isinstance(n, ast.Name) and (n.id in _GROUP_NAMES or n.id.startswith("ProcessGroup")):
            return True
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in _GROUP_WORDS:
            return True
    return False


def _conditions(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """Every condition of ``tree``, with the function it sits in."""
    found: list[tuple[ast.AST, str]] = []

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = node.name
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            found.append((node.test, where))
        elif isinstance(node, ast.comprehension):
            found.extend((t, where) for t in node.ifs)
        elif isinstance(node, ast.match_case) and node.guard is not None:
            found.append((node.guard, where))
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(tree, "<module>")
    return found


def _branches(reads: Callable[[ast.AST], bool]) -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ENGINE.rglob("*.py")):
        for test, where in _conditions(ast.parse(path.read_text())):
            if reads(test):
                key = (str(path.relative_to(ENGINE)), where)
                out.setdefault(key, []).append(f"line {test.lineno}: {ast.unparse(test)}")
    return out


def test_no_condition_in_the_engine_reads_a_dtype() -> None:
    found = _branches(_reads_a_dtype)
    assert {k: v for k, v in found.items() if k not in ALLOWED} == {}
    assert set(ALLOWED) <= set(found), f"stale: {sorted(set(ALLOWED) - set(found))}"


def test_no_condition_in_the_engine_reads_a_group_kind() -> None:
    found = _branches(_reads_a_group_kind)
    assert {k: v for k, v in found.items() if k not in ALLOWED_GROUP_KINDS} == {}
    stale = set(ALLOWED_GROUP_KINDS) - set(found)
    assert not stale, f"stale: {sorted(stale)}"


def test_the_rule_sees_what_it_forbids() -> None:
    """The old exchange's conditions, and the likeness it allows."""
    caught = [
        "wire_dtype not in (None, first.dtype)",
        "summed.elementwise and narrower(wire, t.dtype)",
        "t.dtype == torch.float16",
        "t.is_floating_point()",
        "x if t.dtype is torch.bfloat16 else y",
        "t.element_size() < 4",
    ]
    for src in caught:
        assert _reads_a_dtype(ast.parse(src, mode="eval").body), src
    alike = [
        "(s.dtype, s.device) != (head.dtype, head.device)",
        "a.dtype == b.dtype",
        "v.data_ptr() != p.data_ptr() + start * p.element_size()",
    ]
    for src in alike:
        assert not _reads_a_dtype(ast.parse(src, mode="eval").body), src


def test_the_group_rule_sees_what_it_forbids() -> None:
    """The old exchange's door to the hierarchical allreduce, and a backend test."""
    caught = [
        "route.hierarchical is not None",
        "self._summed is not None and not self._hierarchical",
        "group_ops.backend(group) == 'nccl'",
        "isinstance(group, RingProcessGroup)",
    ]
    for src in caught:
        assert _reads_a_group_kind(ast.parse(src, mode="eval").body), src
    assert not _reads_a_group_kind(ast.parse("slot.chunks and t.cuts", mode="eval").body)

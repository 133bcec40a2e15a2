"""The one averaging rule and the codec interface, without ranks."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

from ringtrain.compression import averaging, resolve
from ringtrain.compression.codec import Codec, SummedCodec, as_codec
from ringtrain.compression.halfprec import BF16Compressor, FP16Compressor, NoneCompressor
from ringtrain.compression.powersgd import PowerSGDReducer
from ringtrain.compression.topk import TopKReducer


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_averages_divide_before_the_sum(dtype: torch.dtype) -> None:
    f = averaging.factors(True, 4, dtype, pre=0.5, post=3.0)
    assert (f.pre, f.post) == (0.5 / 4, 3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
def test_other_averages_divide_after_the_sum(dtype: torch.dtype) -> None:
    f = averaging.factors(True, 4, dtype, pre=0.5, post=3.0)
    assert (f.pre, f.post) == (0.5, 3.0 / 4)


def test_the_caller_may_place_the_division_and_sums_are_not_divided() -> None:
    assert averaging.factors(True, 3, torch.float32, before=True) == averaging.Factors(1 / 3, 1.0)
    assert averaging.factors(True, 3, torch.float16, before=False) == averaging.Factors(1.0, 1 / 3)
    assert averaging.factors(False, 3, torch.float16, 2.0, 5.0) == averaging.Factors(2.0, 5.0)


def test_integers_truncate_toward_zero_as_horovod() -> None:
    t = torch.tensor([-75, 75, -1, 7], dtype=torch.int64)
    averaging.factors(True, 2, t.dtype).after(t)
    assert t.tolist() == [-37, 37, 0, 3]
    s = torch.tensor([-75, 75, -1, 7], dtype=torch.int32)
    assert averaging.mean(s, 2).tolist() == [-37, 37, 0, 3]


def test_a_float_mean_is_a_division() -> None:
    x = torch.randn(1000, dtype=torch.float32)
    assert torch.equal(averaging.mean(x.clone(), 3), x / 3)


def test_every_built_in_compression_is_a_codec() -> None:
    for name in ("none", "fp16", "bf16"):
        codec = as_codec(resolve(name))
        assert isinstance(codec, Codec) and not codec.own_rounds
        assert cast(SummedCodec, codec).elementwise is True
    assert NoneCompressor.wire_dtype(torch.float32) == torch.float32
    assert FP16Compressor.wire_dtype(torch.float64) == torch.float16
    assert BF16Compressor.wire_dtype(torch.float32) == torch.bfloat16
    assert FP16Compressor.wire_dtype(torch.int64) == torch.int64
    for name, cls in (("powersgd", PowerSGDReducer), ("topk", TopKReducer)):
        codec = as_codec(resolve(name))
        assert isinstance(codec, cls) and codec.own_rounds


class _Mine:
    """A Horovod-style compressor of one's own."""

    name = "mine"

    @staticmethod
    def compress(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return t.to(torch.float16), t.dtype

    @staticmethod
    def decompress(t: torch.Tensor, ctx: Any) -> torch.Tensor:
        return t.to(ctx)


class _GroupReducer:
    """A reducer of one's own, written against torch.distributed: it gets the group."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def reduce(self, key: str, flat: torch.Tensor, group: Any) -> torch.Tensor:
        self.seen.append(group)
        return flat


class _Rounds:
    rank, size, group = 0, 1, object()

    def allreduce(self, t: torch.Tensor) -> Any:
        raise AssertionError("not called")

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor) -> Any:
        raise AssertionError("not called")


def test_codecs_of_ones_own_are_wrapped() -> None:
    mine = cast(SummedCodec, as_codec(resolve(_Mine())))
    assert not mine.own_rounds and mine.elementwise is False
    assert mine.wire_dtype(torch.float32) == torch.float16
    assert mine.state_dict() == {}
    inner = _GroupReducer()
    codec = as_codec(inner)
    assert codec.own_rounds
    rounds = _Rounds()
    codec.plan("bucket0", [(2,)])  # type: ignore[union-attr]  # a reducer without plan()
    out = codec.reduce("bucket0", torch.ones(2), rounds)  # type: ignore[union-attr]
    assert torch.equal(out, torch.ones(2)) and inner.seen == [rounds.group]

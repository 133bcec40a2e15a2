"""Tensors seen as flat memory, without a copy where none is needed: what byte-wise
collectives and the rings' messages move."""

from __future__ import annotations

import torch


def flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 1-D tensor of stride 1 (a view when ``t`` is contiguous), which
    ``view(dtype)`` needs. torch calls a tensor contiguous whatever the strides of its size-1
    dimensions, so a one-element tensor may come flat with stride 0 (a gradient expanded from
    a scalar): its one element is read through a stride-1 view instead."""
    out = t.contiguous().reshape(-1)
    if out.numel() == 1 and out.stride(0) != 1:
        return out.as_strided((1,), (1,))
    return out


def as_u8(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``, as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    out = flat(t)
    if out.dtype == torch.uint8:
        return out
    if out.dtype == torch.bool:
        return out.view(torch.uint8)
    if out.is_complex():
        out = torch.view_as_real(out).reshape(-1)
    return out.view(torch.uint8)

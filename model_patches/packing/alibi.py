"""ALiBi from per-document positions: the ``build_alibi_tensor`` record of the packing patches.

Bloom and Falcon (``alibi=True``) build their ALiBi bias from the 2D attention mask:
``slope[h] * ((mask.cumsum(-1) - 1) * mask)``, the key's position among the row's real tokens.
An indexed mask (``1, 1, 1, 2, 2, 0``) breaks that twice: the cumulative sum counts document 2
double, and the final product scales its positions by 2. The replacement gives every key its
position inside its own document (0 at each document start, 0 on padding), which is exactly the
bias that document gets when it runs alone.

It reuses the family's own function for the numbers: ``original(ones)`` is the stock bias of
positions ``0 .. L-1`` (with the family's slopes, dtype and rounding), and the per-document
bias is that tensor gathered at the per-document positions. Bool masks and ``None`` pass
through unchanged; a 0/1 integer mask gives stock's values (one document per row). No host
sync, so it traces into one graph.

(MPT's ALiBi does not read the mask: its bias depends on the key index only, which differs from
the per-document index by a constant within each document, and softmax ignores a constant per
query row. It needs no record.)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from ..targets import parameters_probe
from .masks import document_ids, document_positions, reads_as_document_ids

__all__ = ["ALIBI_NAME", "alibi_probe", "build_alibi"]

#: The module-level function Bloom's and Falcon's model forwards call with the 2D mask.
ALIBI_NAME = "build_alibi_tensor"


def alibi_probe(fn: Any) -> Optional[str]:
    """``build_alibi_tensor(attention_mask, num_heads, dtype)`` -> ``[B * H, 1, L]``, linear in position."""
    shape = parameters_probe(fn, first=("attention_mask", "num_heads", "dtype"))
    if shape:
        return shape
    try:
        out = fn(torch.ones(2, 3, dtype=torch.long), 2, torch.float32)
    except Exception as exc:  # noqa: BLE001 - report any failure as a probe failure
        return f"calling it on a [2, 3] all-ones mask raised {type(exc).__name__}: {exc}"
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (4, 1, 3):
        return f"expected a [batch * heads, 1, seq] = [4, 1, 3] tensor, got {getattr(out, 'shape', type(out))}"
    if bool((out[..., 0] != 0).any()) or not torch.allclose(out[..., 2], 2 * out[..., 1]):
        return "the bias of an all-ones mask is not slope * position (0 at position 0, linear after)"
    return None


def build_alibi(original: Callable) -> Callable:
    """``build_alibi_tensor`` that positions every key inside its own document (see module docstring)."""

    @functools.wraps(original)
    def build_alibi_tensor(attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        if not reads_as_document_ids(attention_mask):
            return original(attention_mask, num_heads, dtype)
        ids = document_ids(attention_mask)
        positions = torch.where(ids != 0, document_positions(ids), torch.zeros_like(ids))
        by_position = original(torch.ones_like(ids), num_heads, dtype)  # [B * H, 1, L]: positions 0 .. L-1
        index = positions.repeat_interleave(num_heads, dim=0)[:, None, :]
        return by_position.gather(-1, index)

    build_alibi_tensor._packing_original = original  # type: ignore[attr-defined]
    return build_alibi_tensor

"""A CPU test double for the flash-attention kernels that keeps Transformers' real flash code path.

``with cpu_flash_attention(): ...`` makes Transformers' lazy kernel loader
(``modeling_flash_attention_utils._lazy_imports``) hand out SDPA-backed stand-ins for
``flash_attn_func`` / ``flash_attn_varlen_func``. Everything around the kernel stays real:
``flash_attention_forward``, the mask handling, ``_upad_input``, ``_get_unpad_data`` and the
``cu_seqlens`` they compute. The varlen stand-in runs one SDPA call per sequence in
``cu_seqlens``, with flash's bottom-right causal alignment and ``window_size``, so a wrong
``cu_seqlens`` shows up as a wrong result, exactly as it would on a GPU.

Use :func:`use_attention` to switch a model built on CPU to ``"flash_attention_2"`` (building it
with that implementation directly fails without the ``flash_attn`` package).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

__all__ = ["cpu_flash_attention", "use_attention", "sdpa_flash_attn_func", "sdpa_flash_attn_varlen_func"]

_CACHED_GLOBALS = (
    "_flash_fn",
    "_flash_varlen_fn",
    "_flash_with_kvcache_fn",
    "_pad_fn",
    "_unpad_fn",
    "_process_flash_kwargs_fn",
    "_process_with_kvcache_kwargs_fn",
    "_loaded_implementation",
)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: Optional[float],
    window: tuple[int, int],
    softcap: float,
) -> torch.Tensor:
    """One sequence: q ``[Tq, H, D]``, k/v ``[Tk, Hk, D]`` -> ``[Tq, H, D]`` (flash semantics)."""
    tq, heads, dim = q.shape
    tk, kv_heads = k.shape[0], k.shape[1]
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = scale if scale is not None else 1.0 / math.sqrt(dim)
    i = torch.arange(tq, device=q.device)[:, None] + (tk - tq)  # bottom-right aligned, as flash >= 2.1
    j = torch.arange(tk, device=q.device)[None, :]
    allowed = torch.ones(tq, tk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= j <= i
    left, right = window
    if left >= 0:
        allowed &= i - j <= left
    if right >= 0:
        allowed &= j - i <= right
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D]
    if softcap:
        scores = (qh.float() @ kh.float().transpose(-1, -2)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ vh.float()
        return out.to(q.dtype).transpose(0, 1)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


def _flash_options(dropout_p: float, alibi_slopes: Any, window_size: Any, softcap: float) -> tuple[tuple[int, int], float]:
    """Check what the double does not implement; return (window, softcap) in flash's convention."""
    if dropout_p:
        raise ValueError(
            f"the CPU flash-attention test double does not implement dropout, got dropout_p={dropout_p}; "
            "set the model's attention_dropout to 0.0 for tests"
        )
    if alibi_slopes is not None:
        raise ValueError("the CPU flash-attention test double does not implement alibi_slopes")
    return tuple(window_size), softcap


def sdpa_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    **_: Any,
) -> torch.Tensor:
    """``flash_attn_varlen_func`` on CPU: q ``[total_q, H, D]``, k/v ``[total_k, Hk, D]`` -> ``[total_q, H, D]``.

    ``deterministic`` and ``return_attn_probs`` are accepted and ignored (as the kernel's
    deterministic mode changes no value here)."""
    window, cap = _flash_options(dropout_p, alibi_slopes, window_size, softcap)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k differ in length: {len(cq)} vs {len(ck)}")
    out = torch.empty_like(q)
    for s in range(len(cq) - 1):
        out[cq[s] : cq[s + 1]] = _attend(
            q[cq[s] : cq[s + 1]], k[ck[s] : ck[s + 1]], v[ck[s] : ck[s + 1]], causal, softmax_scale, window, cap
        )
    return out


def sdpa_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                         softmax_scale: Optional[float] = None, causal: bool = False,
                         window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Any = None,
                         **_: Any) -> torch.Tensor:
    """``flash_attn_func`` on CPU: q ``[B, Tq, H, D]``, k/v ``[B, Tk, Hk, D]`` -> ``[B, Tq, H, D]``."""
    window, cap = _flash_options(dropout_p, alibi_slopes, window_size, softcap)
    return torch.stack([_attend(q[b], k[b], v[b], causal, softmax_scale, window, cap) for b in range(q.shape[0])])


@contextlib.contextmanager
def cpu_flash_attention() -> Iterator[None]:
    """Route Transformers' flash-attention kernels to per-sequence SDPA while the block runs.

    Works with the loaders of Transformers 4.57 (4 kernels) and 5.x (4 or 5). On exit the
    loader and its cached kernels are reset, so a real kernel is imported on next use.
    """
    import transformers.modeling_flash_attention_utils as fu

    original = fu._lazy_imports
    with_kvcache = "_flash_with_kvcache_fn" in fu.lazy_import_flash_attention.__code__.co_names

    def fake_lazy_imports(*args: Any, **kwargs: Any) -> tuple:
        kernels = [sdpa_flash_attn_func, sdpa_flash_attn_varlen_func]
        if with_kvcache:
            kernels.append(None)
        return (*kernels, fu._pad_input, fu._unpad_input)

    saved = {n: getattr(fu, n) for n in _CACHED_GLOBALS if hasattr(fu, n)}
    fu._lazy_imports = fake_lazy_imports
    for name in saved:
        setattr(fu, name, None)
    try:
        yield
    finally:
        fu._lazy_imports = original
        for name in saved:
            setattr(fu, name, None)


def use_attention(model: torch.nn.Module, implementation: str) -> torch.nn.Module:
    """Set ``model``'s attention implementation without the availability check; returns the model.

    For the CPU test double (``"flash_attention_2"`` / ``"flash_attention_3"``) and for switching a
    tiny test model between backends.
    """
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    for cfg in configs.values():
        cfg._attn_implementation = implementation
    return model

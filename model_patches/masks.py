"""Pure helpers for indexed (packed) attention masks; no Transformers import, no patching.

An *indexed mask* is a ``[batch, seq]`` integer tensor: 0 marks padding, and each maximal run of
one non-zero value is one document, ``[1, 1, 1, 2, 2, 3, 0, 0]`` = three documents and two pads.
Runs, not values, define documents, so ``[1, 1, 2, 1]`` holds three documents; ids restart in
every row.

The attention rule these helpers express: a query attends to a key iff both are in the same
document, the key is not after the query (and, with a sliding window ``w``, fewer than ``w``
positions before it), and the key is not padding. A padding query attends to itself only, so
no softmax row is ever empty (an empty row gives NaN and poisons gradients).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = [
    "is_indexed_mask",
    "document_ids",
    "document_lengths",
    "unpad_documents",
    "same_document_mask_function",
    "block_causal_mask_function",
    "dense_block_causal_mask",
]

MaskFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _check_2d(mask: torch.Tensor) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"an indexed attention mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.ndim != 2:
        raise ValueError(
            f"an indexed attention mask must be 2D [batch, seq], got shape {tuple(mask.shape)}; "
            "pass the collator's attention_mask, not a 4D mask"
        )
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"an indexed attention mask must hold integers, got dtype {mask.dtype}")


def is_indexed_mask(mask: object) -> bool:
    """True for a 2D integer tensor holding a value above 1 (more than one document in a row).

    A bool or 0/1 mask is an ordinary padding mask and is left to Transformers' own handling.
    Reading the maximum syncs the device once.
    """
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.dtype == torch.bool:
        return False
    if mask.is_floating_point() or mask.is_complex() or mask.numel() == 0:
        return False
    return bool(mask.max() > 1)


def document_ids(mask: torch.Tensor) -> torch.Tensor:
    """Indexed mask ``[B, L]`` (int or bool) -> int64 ``[B, L]``: run number 1, 2, ... per row, 0 on padding.

    Raises ValueError on negative values.
    """
    _check_2d(mask)
    m = mask.long()
    if m.numel() and bool((m < 0).any()):
        raise ValueError("an indexed attention mask must be >= 0 (0 = padding), got negative values")
    starts = m != 0
    starts[:, 1:] &= m[:, 1:] != m[:, :-1]
    return torch.where(m != 0, starts.long().cumsum(-1), torch.zeros_like(m))


def document_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Token counts of every document, row by row, in order (int32 ``[num_documents]``)."""
    ids = document_ids(mask)
    flat = ids.flatten()
    keep = flat != 0
    if not bool(keep.any()):
        return torch.zeros(0, dtype=torch.int32, device=mask.device)
    # A document = a run of one id within one row; give each (row, id) a unique key.
    row = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(ids.shape[1])
    key = (row * (ids.shape[1] + 1) + flat)[keep]
    _, counts = torch.unique_consecutive(key, return_counts=True)
    return counts.to(torch.int32)


def unpad_documents(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Indexed mask ``[B, L]`` -> (indices, cu_seqlens, max_seqlen) with one sequence per document.

    ``indices``: int64 positions of non-padding tokens in ``mask.flatten()``; ``cu_seqlens``:
    int32 ``[num_documents + 1]`` starting at 0; ``max_seqlen``: the longest document (Python int).
    This is what flash-attention varlen kernels need so that documents never see each other.
    """
    lengths = document_lengths(mask)
    indices = torch.nonzero(mask.flatten() != 0, as_tuple=False).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    max_len = int(lengths.max()) if lengths.numel() else 0
    return indices, cu, max_len


def same_document_mask_function(doc_ids: torch.Tensor, kv_length: Optional[int] = None) -> MaskFn:
    """``mask_mod(b, h, q, kv)`` that is True iff q and kv are in one document (kv not padding), or q == kv.

    ``doc_ids``: int ``[B, L]`` from :func:`document_ids`. ``kv_length`` (a static cache longer
    than the mask): ids are padded with 0 (padding) up to it. Combine with a causal function;
    works broadcast, under ``torch.vmap`` and inside a compiled ``create_block_mask`` (no clamps:
    they trip the CPU inductor backend).
    """
    if kv_length is not None and kv_length > doc_ids.shape[-1]:
        doc_ids = torch.nn.functional.pad(doc_ids, (0, kv_length - doc_ids.shape[-1]))

    def same_document(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        kv_doc = doc_ids[b, kv]
        return ((doc_ids[b, q] == kv_doc) & (kv_doc != 0)) | (q == kv)

    return same_document


def block_causal_mask_function(doc_ids: torch.Tensor, sliding_window: Optional[int] = None) -> MaskFn:
    """Causal (optionally sliding-window) AND same-document; a complete flex ``mask_mod``."""
    same = same_document_mask_function(doc_ids)
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")

    def block_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        ok = (kv <= q) & same(b, h, q, kv)
        if sliding_window is not None:
            ok = ok & (q - kv < sliding_window)
        return ok

    return block_causal


def dense_block_causal_mask(mask: torch.Tensor, sliding_window: Optional[int] = None) -> torch.Tensor:
    """bool ``[B, 1, L, L]`` (True = attend) of :func:`block_causal_mask_function`; a reference for tests."""
    ids = document_ids(mask)
    b, length = ids.shape
    fn = block_causal_mask_function(ids, sliding_window)
    dev = ids.device
    return fn(
        torch.arange(b, device=dev)[:, None, None, None],
        torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev),
        torch.arange(length, device=dev)[None, None, :, None],
        torch.arange(length, device=dev)[None, None, None, :],
    )

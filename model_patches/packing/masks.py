"""Pure helpers for indexed (packed) attention masks; no Transformers import, no patching.

An *indexed mask* is a ``[batch, seq]`` integer tensor: 0 marks padding, and each maximal run of
one non-zero value among the row's real tokens is one document, ``[1, 1, 1, 2, 2, 3, 0, 0]`` =
three documents and two pads. Runs, not values, define documents, so ``[1, 1, 2, 1]`` holds three
documents; ids restart in every row. Padding does not end a run: ``[1, 1, 0, 0, 1]`` is one
document with two pads inside, which is what Transformers' ``generate()`` makes of a right-padded
prompt (the new tokens' 1s after the prompt's padding). An ordinary 0/1 padding mask is therefore
one document per row, wherever its padding lies, exactly stock's padding mask; only the collator's
indexed masks (1, 2, 3, ...) mark several documents. Any integer mask can be read as document ids
without looking at its values first (no host sync).
Floating masks (``mask.float()``, bf16) are read the same way when every value is a
non-negative integer that the dtype represents exactly (bf16: up to 256, fp16: 2048, fp32:
2**24); anything else is refused, because a rounded id can merge two neighbouring documents.

The attention rule these helpers express: a query attends to a key iff both are in the same
document, the key is not after the query (and, with a sliding window ``w``, fewer than ``w``
positions before it), and the key is not padding. A padding query gets what Transformers' own
padding mask gives it: every non-padding key the causal (and window) rule allows, whatever its
document. Its output is never used, but it must be stock's: an MoE block routes that row like
any other and runs each expert once over the rows routed to it, so a padding row that differs
from stock changes the shape of the experts' matmuls and, through them, real tokens' results by
a few ulps. A 0/1 mask therefore yields exactly stock's mask, padding rows included. A padding
query with no such key (left padding, a padding row) gets an empty row, as in stock, and every
backend handles it as stock does: eager softmaxes a row of ``finfo.min`` to uniform weights,
sdpa (a bool mask) and flex_attention return zeros for it, not NaN.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = [
    "reads_as_document_ids",
    "check_mask_values",
    "is_indexed_mask",
    "document_ids",
    "document_lengths",
    "split_at_position_resets",
    "document_positions",
    "unpad_documents",
    "same_document_mask_function",
    "block_causal_mask_function",
    "dense_block_causal_mask",
]

MaskFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


#: Largest integer each floating dtype holds exactly (with all smaller ones): 2 ** (mantissa bits + 1).
_EXACT_INT = {torch.bfloat16: 2**8, torch.float16: 2**11, torch.float32: 2**24, torch.float64: 2**53}


def _check_2d(mask: torch.Tensor) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"an indexed attention mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.ndim != 2:
        raise ValueError(
            f"an indexed attention mask must be 2D [batch, seq], got shape {tuple(mask.shape)}; "
            "pass the collator's attention_mask, not a 4D mask"
        )
    if mask.is_complex() or (mask.is_floating_point() and mask.dtype not in _EXACT_INT):
        raise TypeError(
            f"an indexed attention mask must hold integers (int or bool, or float / bf16 / fp16 "
            f"holding whole numbers), got dtype {mask.dtype}"
        )


def reads_as_document_ids(mask: object) -> bool:
    """True for a 2D integer or floating tensor: the packing patches read it as document ids.

    Decided from type, rank and dtype only (never the values), so it costs no host sync and
    compiles without a graph break. Bool masks (pure padding masks) and 4D masks are False.
    """
    return (
        isinstance(mask, torch.Tensor)
        and mask.ndim == 2
        and mask.dtype != torch.bool
        and not mask.is_complex()
        and (not mask.is_floating_point() or mask.dtype in _EXACT_INT)
    )


def _bad_values(mask: torch.Tensor) -> tuple[torch.Tensor, str]:
    """(bool scalar "some value is invalid", what valid means) for a 2D int / float mask."""
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=torch.bool, device=mask.device), ""
    if not mask.is_floating_point():
        return (mask < 0).any(), "an indexed attention mask must be >= 0 (0 = padding), got negative values"
    limit = _EXACT_INT[mask.dtype]
    bad = (mask < 0) | (mask > limit) | (mask != torch.floor(mask)) | ~torch.isfinite(mask)
    return bad.any(), (
        f"a floating ({mask.dtype}) attention mask is read as document ids, so every value must be a "
        f"whole number in [0, {limit}] ({mask.dtype} holds larger ids inexactly, which can merge two "
        "documents); got a value outside that. Fix: pass the collator's integer mask "
        "(attention_mask.long()), or a 0/1 mask"
    )


def check_mask_values(mask: torch.Tensor) -> None:
    """Refuse negative ids and (floating masks) ids that are not exact whole numbers.

    On CPU outside ``torch.compile`` this raises ``ValueError`` (reading one flag costs nothing
    there). On an accelerator or while compiling it is a ``torch._assert_async`` (no host sync, no
    graph break): the error surfaces as a ``RuntimeError`` carrying the same message.
    """
    bad, message = _bad_values(mask)
    if not message:
        return
    if mask.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(bad):
            raise ValueError(message)
        return
    torch._assert_async(~bad, message)


def is_indexed_mask(mask: object) -> bool:
    """True for a 2D integer or floating tensor holding a value above 1 (several documents in a row).

    Reads the values (one host sync): for eager-only checks and tests. The patches themselves
    use :func:`reads_as_document_ids`, which does not look at the values.
    """
    if not reads_as_document_ids(mask) or mask.numel() == 0:  # type: ignore[union-attr]
        return False
    return bool(mask.max() > 1)  # type: ignore[union-attr]


def _previous_real(values: torch.Tensor, real: torch.Tensor, fill: int) -> torch.Tensor:
    """``[B, L]``: at each position, ``values`` at the closest earlier real position of its row
    (``fill`` where there is none)."""
    index = torch.arange(values.shape[1], device=values.device).expand_as(values)
    last = torch.where(real, index, torch.full_like(index, -1)).cummax(-1).values  # at or before each position
    before = torch.cat([torch.full_like(last[:, :1], -1), last[:, :-1]], dim=1)  # strictly before
    found = values.gather(1, torch.where(before >= 0, before, torch.zeros_like(before)))
    return torch.where(before >= 0, found, torch.full_like(found, fill))


def _run_starts(ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """bool ``[B, L]``: real tokens whose id differs from the previous real token's (padding skipped)."""
    return real & (ids != _previous_real(ids, real, 0))


def document_ids(mask: torch.Tensor) -> torch.Tensor:
    """Indexed mask ``[B, L]`` (int, bool or whole-number float) -> int64 ``[B, L]``: run number
    1, 2, ... per row (runs of one value among real tokens, padding skipped), 0 on padding.

    Raises ValueError on negative or (float) non-whole values, see :func:`check_mask_values`.
    No host sync on the happy path; traces into one graph under ``torch.compile``.
    """
    _check_2d(mask)
    if mask.numel():
        check_mask_values(mask)
    m = mask.long()
    real = m != 0
    return torch.where(real, _run_starts(m, real).long().cumsum(-1), torch.zeros_like(m))


def split_at_position_resets(ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids ``[B, L]`` split further wherever ``position_ids`` ``[B or 1, L]`` do not step by one.

    Packed ``position_ids`` (0, 1, 2, 0, 1, ...) mark documents too, even under a 0/1 or all-ones
    mask (``DataCollatorWithFlattening``-style batches): a token whose position does not continue
    its previous real token's starts a new document. Across padding inside a document (padding is
    skipped, as in :func:`document_ids`) a position continues when it steps by one (``generate()``
    counts positions past a right-padded prompt's pads) or by the distance in tokens (positions
    that count the pads, such as the default ``arange``). Returns renumbered int64 ids, 0 on padding.
    """
    pos = position_ids.expand(ids.shape[0], -1).long()
    real = ids != 0
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    step = pos - _previous_real(pos, real, 0)
    continues = (step == 1) | (step == index - _previous_real(index, real, 0))
    starts = _run_starts(ids, real) | (real & ~continues)
    return torch.where(real, starts.long().cumsum(-1), torch.zeros_like(ids))


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """Position of every real token inside its document (0 at each document start; padding inside
    a document is not counted, as in Transformers' positions from a padding mask), int64 ``[B, L]``.
    Padding positions hold the count of real tokens before them in the document (callers mask them)."""
    real = ids != 0
    count = real.long().cumsum(-1)  # real tokens up to and including each position
    first = torch.where(_run_starts(ids, real), count, torch.zeros_like(count)).cummax(-1).values
    return count - first


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
    """``mask_mod(b, h, q, kv)``: kv is not padding, and q is in kv's document or is padding.

    The padding part of Transformers' own mask with "same document" added for real queries (see
    the module docstring): for a 0/1 mask it equals Transformers' ``padding_mask_function``.
    ``doc_ids``: int ``[B, L]`` from :func:`document_ids`. ``kv_length`` (a static cache longer
    than the mask): ids are padded with 0 (padding) up to it. Combine with a causal function;
    works broadcast, under ``torch.vmap`` and inside a compiled ``create_block_mask`` (no clamps:
    they trip the CPU inductor backend).
    """
    if kv_length is not None and kv_length > doc_ids.shape[-1]:
        doc_ids = torch.nn.functional.pad(doc_ids, (0, kv_length - doc_ids.shape[-1]))

    def same_document(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        kv_doc = doc_ids[b, kv]
        q_doc = doc_ids[b, q]
        return (kv_doc != 0) & ((q_doc == kv_doc) | (q_doc == 0))

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

"""The packing oracle: a packed row must equal each of its documents run alone.

Shared by the tests, ``python -m bench`` and users who want to check their own setup:
:func:`tiny_model` builds a random-init Hugging Face causal LM (hidden 64, 2 layers, no
download), :func:`packed_batch` makes a packed batch with padding, :func:`logits_gap` and
:func:`grad_gap` measure how far the packed forward / backward is from the per-document truth.
The per-document truth runs each document alone, unmasked, under eager attention.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from ..packing.collator import PackingCollator
from .flash_double import cpu_flash_attention, use_attention
from .tiny_models import tiny_causal_lm

__all__ = ["FAMILIES_UNDER_TEST", "BACKENDS", "tiny_model", "packed_batch", "documents", "logits_gap", "grad_gap", "backend"]

_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, attention_dropout=0.0,
)
#: family -> (model_type, extra config). Sliding windows (4) are shorter than the documents so
#: that a wrong window shows up.
FAMILIES_UNDER_TEST: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "mistral": ("mistral", {"sliding_window": 4, "head_dim": 16}),
    "gemma3": ("gemma3_text", {
        "sliding_window": 4, "head_dim": 16, "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 16,
    }),
    "qwen3_moe": ("qwen3_moe", {
        "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    }),
}
BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2")

#: document lengths of :func:`packed_batch`: rows [7, 5], [6, 4, 2], [3, 3] + 6 pads at 12.
_LENGTHS = (7, 6, 5, 4, 3, 3, 2)


def tiny_model(family: str, seed: int = 0, implementation: str = "eager") -> torch.nn.Module:
    """Random-init fp32 causal LM of ``family`` (a key of :data:`FAMILIES_UNDER_TEST`), eval mode,
    on the ``implementation`` attention backend."""
    model_type, extra = FAMILIES_UNDER_TEST[family]
    return tiny_causal_lm(model_type, implementation, seed, sizes=_COMMON, family_sizes={}, **extra)


def packed_batch(seed: int = 0, max_length: int = 12, lengths: tuple[int, ...] = _LENGTHS) -> dict[str, torch.Tensor]:
    """A collated batch (batch > 1, padding in the last row) of random token documents."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, 128, (n,), generator=g).tolist() for n in lengths]
    # The oracle runs this batch on stock Transformers too (the negative control that must leak),
    # so it is built whether or not the packing patches are live.
    return PackingCollator(max_length, require_packing=False)(docs)


def documents(batch: dict[str, torch.Tensor]) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document in a collated batch."""
    out = []
    mask = batch["attention_mask"]
    for r in range(mask.shape[0]):
        row = mask[r].tolist()
        start = 0
        for i in range(1, len(row) + 1):
            if i == len(row) or row[i] != row[start]:
                if row[start] != 0:
                    out.append((r, start, i))
                start = i
    return out


@contextlib.contextmanager
def backend(model: torch.nn.Module, implementation: str) -> Iterator[torch.nn.Module]:
    """Run ``model`` under ``implementation`` (flash on CPU through the test double), then restore."""
    before = model.config._attn_implementation
    flash = "flash" in implementation and not torch.cuda.is_available()
    with cpu_flash_attention() if flash else contextlib.nullcontext():
        use_attention(model, implementation)
        try:
            yield model
        finally:
            use_attention(model, before)


def _forward(model: torch.nn.Module, batch: dict[str, torch.Tensor], use_cache: bool, masked: bool = True) -> torch.Tensor:
    kwargs = {"attention_mask": batch["attention_mask"]} if masked else {}
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=use_cache, **kwargs).logits


def _document_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    refs = []
    with backend(model, "eager"):
        for r, s, e in documents(batch):
            doc = {k: v[r : r + 1, s:e] for k, v in batch.items()}
            refs.append(_forward(model, doc, use_cache=False, masked=False)[0])
    return refs


def logits_gap(model: torch.nn.Module, batch: dict[str, torch.Tensor], implementation: str, use_cache: bool = False) -> float:
    """max |packed logits - each document alone| over every real token (fp32)."""
    with torch.no_grad():
        refs = _document_logits(model, batch)
        with backend(model, implementation):
            packed = _forward(model, batch, use_cache)
    return max(float((packed[r, s:e] - ref).abs().max()) for (r, s, e), ref in zip(documents(batch), refs))


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")


def grad_gap(model: torch.nn.Module, batch: dict[str, torch.Tensor], implementation: str,
             use_cache: bool = False) -> tuple[float, float]:
    """(max |grad packed - sum of per-document grads|, max |per-document grad|) over all parameters.

    The packed loss is the token-summed cross-entropy of the batch's labels; each document's
    loss uses its own slice of the labels (its first label is -100 either way).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    with backend(model, "eager"):
        for r, s, e in documents(batch):
            doc = {k: v[r : r + 1, s:e] for k, v in batch.items()}
            _loss(_forward(model, doc, use_cache=False, masked=False), doc["labels"]).backward()
    truth = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    model.zero_grad(set_to_none=True)
    with backend(model, implementation):
        _loss(_forward(model, batch, use_cache), batch["labels"]).backward()
    got = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    model.zero_grad(set_to_none=True)
    gap = max(float((a - b).abs().max()) for a, b in zip(got, truth))
    scale = max(float(b.abs().max()) for b in truth)
    return gap, scale

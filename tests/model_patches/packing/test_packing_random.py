"""The packing oracle on layouts hypothesis draws: documents and padding anywhere in a row."""

from __future__ import annotations

import functools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model_patches import enable_packing
from model_patches.testing.packing_oracle import logits_gap, tiny_model

TOL = 1e-4


@functools.lru_cache(maxsize=None)
def _model(family: str) -> torch.nn.Module:
    return tiny_model(family, seed=1)


@st.composite
def batches(draw) -> dict[str, torch.Tensor]:
    """Rows of one length: runs of pads (id 0) and documents (ids that may repeat across runs)."""
    length, rows = draw(st.integers(4, 14)), draw(st.integers(1, 3))
    mask = torch.zeros(rows, length, dtype=torch.long)
    positions = torch.zeros_like(mask)
    for r in range(rows):
        i, prev = 0, 0
        while i < length:
            n = draw(st.integers(1, length - i))
            if draw(st.booleans()):  # a document; its id differs from a document right before it
                prev = draw(st.sampled_from([v for v in (1, 2, 3) if v != prev]))
                mask[r, i : i + n] = prev
                positions[r, i : i + n] = torch.arange(n)
            else:  # padding
                prev = 0
            i += n
        if not mask[r].any():
            mask[r, 0] = 1  # at least one document per row
    seed = draw(st.integers(0, 2**16))
    ids = torch.randint(1, 128, mask.shape, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}


@settings(max_examples=12)
@given(batches(), st.sampled_from(["llama", "mistral"]), st.sampled_from(["eager", "sdpa", "flash_attention_2"]),
       st.booleans())
def test_random_layouts_equal_documents_alone(batch, family, implementation, use_cache) -> None:
    with enable_packing():
        gap = logits_gap(_model(family), batch, implementation, use_cache=use_cache)
    assert gap <= TOL, f"{family}/{implementation}: {gap:.3g} on mask {batch['attention_mask'].tolist()}"

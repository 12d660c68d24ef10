"""The ``train`` section's data: instruction-tuning-like documents, padded or packed.

Lengths (:class:`LengthDistribution`): log-normal with median 64 tokens and sigma 1.0, at least
4 tokens, clipped to the row length: many short documents and a long tail, the shape of
instruction-tuning sets (most prompt + answer pairs are short, a few are long). Unclipped its
mean is 105 tokens (64 e^(sigma^2/2)), its 90th percentile 230 and its 99th 655;
:meth:`LengthDistribution.stats` gives the figures after clipping to a row.

Tokens: Zipf-like ids (``id = floor(V u^4)``, ``u`` uniform), so that a random model learns
the unigram frequencies within a few steps and the losses move; seeded per document.

Each optimizer step sees ``docs_per_step`` documents, in the same order in every variant:

- padded (stock): one document per row, padded to the longest of the step; labels are the ids
  with -100 on padding and on each document's first token (a causal LM never predicts a first
  token; :class:`model_patches.PackingCollator` masks it the same way);
- packed: ``PackingCollator(row_len)`` over the same documents (first-fit-decreasing rows,
  indexed attention mask, per-document ``position_ids``).

Both layouts score exactly the same tokens, so the per-token mean loss of a step is the same
number in both (up to fp32 round-off).
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from typing import Any, Optional

import torch


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Log-normal document lengths (tokens): ``median``, ``sigma``, at least ``minimum``."""

    median: int = 64
    sigma: float = 1.0
    minimum: int = 4

    def draw(self, n: int, max_len: int, seed: int) -> list[int]:
        """``n`` lengths in ``minimum..max_len``, the same for the same ``seed``."""
        if max_len < self.minimum:
            raise ValueError(f"max_len must be at least the minimum length {self.minimum}, got {max_len}")
        rng = random.Random(seed)
        return [min(max_len, max(self.minimum, round(rng.lognormvariate(math.log(self.median), self.sigma))))
                for _ in range(n)]

    def stats(self, max_len: int, n: int = 20000, seed: int = 12345) -> dict[str, float]:
        """Mean, median, 90th and 99th percentile and the clipped fraction of ``n`` draws at ``max_len``."""
        xs = sorted(self.draw(n, max_len, seed))
        return {"mean": statistics.fmean(xs), "median": float(xs[n // 2]), "p90": float(xs[int(0.9 * n)]),
                "p99": float(xs[int(0.99 * n)]), "clipped": sum(x == max_len for x in xs) / n}

    def describe(self, max_len: int) -> str:
        s = self.stats(max_len)
        return (f"log-normal document lengths, median {self.median} tokens, sigma {self.sigma}, at least "
                f"{self.minimum}, clipped to {max_len}: mean {s['mean']:.0f}, median {s['median']:.0f}, "
                f"p90 {s['p90']:.0f}, p99 {s['p99']:.0f}, {100 * s['clipped']:.1f}% clipped")


DISTRIBUTION = LengthDistribution()


def document(length: int, vocab: int, seed: int) -> list[int]:
    """``length`` Zipf-like token ids in ``0..vocab-1`` (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return (vocab * torch.rand(length, generator=g) ** 4).long().clamp_(0, vocab - 1).tolist()


def step_documents(steps: int, docs_per_step: int, max_len: int, vocab: int, seed: int = 0,
                   distribution: LengthDistribution = DISTRIBUTION) -> list[list[list[int]]]:
    """For each of ``steps`` steps, ``docs_per_step`` documents (token-id lists)."""
    if steps <= 0 or docs_per_step <= 0:
        raise ValueError(f"steps and docs_per_step must be positive, got {steps} and {docs_per_step}")
    lengths = distribution.draw(steps * docs_per_step, max_len, seed)
    docs = [document(n, vocab, seed * 1_000_003 + i) for i, n in enumerate(lengths)]
    return [docs[s * docs_per_step:(s + 1) * docs_per_step] for s in range(steps)]


def context_documents(steps: int, length: int, vocab: int, seed: int = 0,
                      warmup: Optional[int] = None) -> list[list[list[int]]]:
    """One document of exactly ``length`` tokens per step (the longest-context probes).

    ``warmup``: the first step's document has that many tokens instead (a cheap warm-up step that
    creates the optimizer state and whatever a first call keeps, before the measured steps).
    """
    if length <= 1 or (warmup is not None and warmup <= 1):
        raise ValueError(f"a context document needs at least 2 tokens, got length={length}, warmup={warmup}")
    lengths = [length] * steps
    if warmup is not None and steps > 0:
        lengths[0] = warmup
    return [[document(n, vocab, seed * 1_000_003 + s)] for s, n in enumerate(lengths)]


def padded_batch(docs: list[list[int]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """``docs`` one per row, right-padded to the longest: ``input_ids``, 0/1 ``attention_mask``,
    ``labels`` (-100 on padding and on each first token), int64 ``[len(docs), longest]``."""
    longest = max(len(d) for d in docs)
    ids = torch.full((len(docs), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, d in enumerate(docs):
        ids[r, :len(d)] = torch.tensor(d)
        mask[r, :len(d)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_batch(docs: list[list[int]], row_len: int, pad_token_id: int = 0,
                 require_packing: bool = True) -> dict[str, torch.Tensor]:
    """``docs`` packed by :class:`model_patches.PackingCollator` into rows of ``row_len``."""
    from model_patches import PackingCollator

    return PackingCollator(row_len, pad_token_id=pad_token_id, require_packing=require_packing)(docs)


def real_tokens(batch: dict[str, Any]) -> int:
    """Tokens that are not padding (``attention_mask != 0``)."""
    return int((batch["attention_mask"] != 0).sum())


def scored_tokens(batch: dict[str, Any]) -> int:
    """Tokens the loss scores: labels that are not -100 after the causal shift."""
    return int((batch["labels"][:, 1:] != -100).sum())

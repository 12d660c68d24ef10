"""Which tokens of a packed batch each process of a context-parallel group holds.

Causal attention inside a document costs a query in proportion to its position in the document,
so an even split of the row's tokens is not an even split of the work: one long document on one
process outweighs many short ones on another (by about 20% at 4 processes on log-normal lengths).
Every document is therefore cut into ``2P`` pieces as equal as possible, and process ``r`` holds
pieces ``r`` and ``2P - 1 - r`` (head and tail) of every document: the same causal work per process
for each document, to within a token per piece (torch's per-document head-tail balancer for flex
attention does the same). Processes may then hold a few tokens more or fewer: each row is padded to
the longest, with padding that attends only to itself and carries no label.

Documents come from ``position_ids`` (each document counts from 0, as packing gives them) or from
an indexed mask. Everything here is index arithmetic on ``[B, T]`` tensors; no process group.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["DocumentLayout", "document_ids", "pairs_per_rank"]


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` document ids of packed rows from their ``position_ids`` (a document starts where a
    position is 0, or does not follow the one before it): 1, 2, ... in each row."""
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be [batch, tokens], got shape {tuple(position_ids.shape)}")
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.long().cumsum(dim=1)


def _pieces(start: int, n: int, world: int) -> list[tuple[int, int, int]]:
    """``(rank, begin, end)`` of a document's ``2 * world`` pieces (sizes differ by at most 1)."""
    cuts = [start + (n * k) // (2 * world) for k in range(2 * world + 1)]
    return [(k if k < world else 2 * world - 1 - k, cuts[k], cuts[k + 1]) for k in range(2 * world)]


@dataclasses.dataclass(frozen=True)
class DocumentLayout:
    """Per-document head-tail placement of a batch over ``world`` processes.

    ``index``: ``[world, B, L]`` int64, the global token index (in ``0..T-1``) each process holds at
    each local slot, in increasing order, ``-1`` for padding; ``tokens``: ``T``."""

    index: torch.Tensor
    tokens: int

    @property
    def world(self) -> int:
        return self.index.shape[0]

    @property
    def local_tokens(self) -> int:
        return self.index.shape[2]

    @classmethod
    def of(cls, documents: torch.Tensor, world: int) -> "DocumentLayout":
        """The layout of rows whose tokens belong to ``documents`` (``[B, T]`` ids, equal ids adjacent)."""
        if world < 1:
            raise ValueError(f"a context-parallel group has at least 1 process, got {world}")
        if documents.dim() != 2:
            raise ValueError(f"documents must be [batch, tokens], got shape {tuple(documents.shape)}")
        rows, tokens = documents.shape
        held: list[list[list[int]]] = [[[] for _ in range(rows)] for _ in range(world)]
        for b in range(rows):
            row = documents[b].tolist()
            start = 0
            for t in range(1, tokens + 1):
                if t == tokens or row[t] != row[start]:
                    for rank, begin, end in _pieces(start, t - start, world):
                        held[rank][b].extend(range(begin, end))
                    start = t
        length = max(1, max(len(ix) for per_rank in held for ix in per_rank))
        index = torch.full((world, rows, length), -1, dtype=torch.long)
        for rank in range(world):
            for b in range(rows):
                ix = sorted(held[rank][b])
                index[rank, b, :len(ix)] = torch.tensor(ix, dtype=torch.long)
        return cls(index, tokens)

    def shard(self, t: torch.Tensor, rank: int, fill: int) -> torch.Tensor:
        """``[B, L]``: ``t``'s (``[B, T]``) values at process ``rank``'s tokens, ``fill`` at padding."""
        if t.shape[:2] != (self.index.shape[1], self.tokens):
            raise ValueError(f"expected [{self.index.shape[1]}, {self.tokens}], got shape {tuple(t.shape)}")
        ix = self.index[rank].to(t.device)
        out = t.gather(1, ix.clamp(min=0))
        return out.masked_fill(ix < 0, fill)

    def unshard(self, gathered: torch.Tensor) -> torch.Tensor:
        """Rank-major local outputs ``[B, world * L, ...]`` back to ``[B, T, ...]`` in row order."""
        rows = self.index.shape[1]
        where = self.index.permute(1, 0, 2).reshape(rows, -1).to(gathered.device)  # [B, world * L]
        out = gathered.new_zeros((rows, self.tokens, *gathered.shape[2:]))
        keep = where >= 0
        for b in range(rows):
            out[b, where[b, keep[b]]] = gathered[b, keep[b]]
        return out


def pairs_per_rank(documents: torch.Tensor, layout: DocumentLayout) -> list[int]:
    """The causal query-key pairs inside documents each process computes (attention work per
    process, padding excluded), summed over the rows."""
    counts = []
    for rank in range(layout.world):
        total = 0
        for b in range(documents.shape[0]):
            q = layout.index[rank, b]
            q = q[q >= 0]
            docs = documents[b]
            same = docs[q][:, None] == docs[None, :]
            total += int((same & (torch.arange(layout.tokens)[None, :] <= q[:, None])).sum())
        counts.append(total)
    return counts

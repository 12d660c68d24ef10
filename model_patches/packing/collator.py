"""``PackingCollator``: documents -> fixed-length packed rows with an indexed attention mask.

Rows are filled by first-fit-decreasing bin packing. Each row holds whole documents one after
another, then padding; the attention mask numbers the documents ``1, 2, ...`` and marks padding
0, which :func:`model_patches.enable_packing` turns into "same document, causal, not padding"
on every attention backend. Needs only torch (no Transformers import).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence, Union

import torch

__all__ = ["PackingCollator", "first_fit_decreasing"]

logger = logging.getLogger(__name__)

Example = Union[Sequence[int], Mapping[str, Any]]


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of total <= ``capacity`` (first fit, longest first).

    Every length must be in ``1..capacity``. Uses at most ``11/9 OPT + 6/9`` bins; any two bins
    together exceed ``capacity``. Bins come in creation order, items longest first.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be a positive int, got {capacity}")
    bad = [n for n in lengths if not 1 <= n <= capacity]
    if bad:
        raise ValueError(f"every length must be in 1..{capacity}, got {bad[:5]}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        for b, room in enumerate(free):
            if room >= n:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(capacity - n)
    return bins


class PackingCollator:
    """Pack examples into rows of ``max_length`` tokens.

    Examples are token-id lists or dicts with ``input_ids`` and optional ``labels`` (same
    length; default: the ids). Returns int64 tensors ``[rows, max_length]``:

    - ``input_ids``: documents back to back, then ``pad_token_id``;
    - ``labels``: the labels, with -100 on each document's first label and on padding, so no
      position learns to predict the next document's first token (HF models shift labels);
    - ``attention_mask``: 1, 2, ... per document within the row, 0 on padding;
    - ``position_ids``: 0, 1, ... restarting at each document, 0 on padding.

    Documents longer than ``max_length`` are truncated (``overlong="truncate"``) or cut into
    ``max_length`` pieces that become separate documents (``"split"``), with a logged warning;
    ``"error"`` raises instead. Empty documents are dropped with a warning.
    """

    def __init__(
        self,
        max_length: int,
        *,
        pad_token_id: int = 0,
        overlong: str = "truncate",
        label_pad_id: int = -100,
    ) -> None:
        if not isinstance(max_length, int) or max_length <= 0:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        if overlong not in ("truncate", "split", "error"):
            raise ValueError(f"overlong must be 'truncate', 'split' or 'error', got {overlong!r}")
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.overlong = overlong
        self.label_pad_id = label_pad_id

    def _documents(self, examples: Sequence[Example]) -> list[tuple[list[int], list[int]]]:
        docs: list[tuple[list[int], list[int]]] = []
        n_long = n_empty = 0
        for k, ex in enumerate(examples):
            if isinstance(ex, Mapping):
                if "input_ids" not in ex:
                    raise ValueError(f"example {k} is a dict without 'input_ids' (keys: {sorted(ex)})")
                ids = [int(t) for t in ex["input_ids"]]
                labels = [int(t) for t in ex["labels"]] if ex.get("labels") is not None else list(ids)
                if len(labels) != len(ids):
                    raise ValueError(
                        f"example {k}: labels has {len(labels)} entries but input_ids has {len(ids)}; "
                        "they must align token for token (the model shifts them)"
                    )
            elif isinstance(ex, (str, bytes)) or not isinstance(ex, Sequence) and not isinstance(ex, torch.Tensor):
                raise TypeError(
                    f"example {k} must be a list of token ids or a dict with 'input_ids', got {type(ex).__name__}"
                )
            else:
                ids = [int(t) for t in ex]
                labels = list(ids)
            if not ids:
                n_empty += 1
                continue
            if len(ids) > self.max_length:
                n_long += 1
                if self.overlong == "error":
                    raise ValueError(
                        f"example {k} has {len(ids)} tokens, more than max_length={self.max_length}; "
                        "pass overlong='truncate' or 'split', or raise max_length"
                    )
                if self.overlong == "truncate":
                    ids, labels = ids[: self.max_length], labels[: self.max_length]
                else:
                    for s in range(0, len(ids), self.max_length):
                        docs.append((ids[s : s + self.max_length], labels[s : s + self.max_length]))
                    continue
            docs.append((ids, labels))
        if n_long:
            action = "truncated" if self.overlong == "truncate" else "split into pieces"
            logger.warning("%d example(s) longer than max_length=%d were %s", n_long, self.max_length, action)
        if n_empty:
            logger.warning("%d empty example(s) were dropped", n_empty)
        return docs

    def __call__(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        if examples is None or len(examples) == 0:
            raise ValueError("PackingCollator got no examples; pass a non-empty list of token-id lists or dicts")
        docs = self._documents(examples)
        if not docs:
            raise ValueError(f"PackingCollator got {len(examples)} example(s), all empty; nothing to pack")
        bins = first_fit_decreasing([len(d[0]) for d in docs], self.max_length)
        shape = (len(bins), self.max_length)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, self.label_pad_id, dtype=torch.long)
        mask = torch.zeros(shape, dtype=torch.long)
        positions = torch.zeros(shape, dtype=torch.long)
        for r, members in enumerate(bins):
            start = 0
            for number, d in enumerate(members, start=1):
                ids, labs = docs[d]
                end = start + len(ids)
                input_ids[r, start:end] = torch.tensor(ids)
                labels[r, start + 1 : end] = torch.tensor(labs[1:], dtype=torch.long)
                mask[r, start:end] = number
                positions[r, start:end] = torch.arange(len(ids))
                start = end
        return {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "position_ids": positions}

    @staticmethod
    def efficiency(batch: Mapping[str, torch.Tensor]) -> float:
        """Real tokens / row slots of a collated batch."""
        mask = batch["attention_mask"]
        return float((mask != 0).sum()) / float(mask.numel())

"""``PackingCollator``: documents -> fixed-length packed rows with an indexed attention mask.

Rows are filled by first-fit-decreasing bin packing. Each row holds whole documents one after
another, then padding; the attention mask numbers the documents ``1, 2, ...`` and marks padding
0, which :func:`model_patches.enable_packing` turns into "same document, causal, not padding"
on every attention backend. Stock Transformers reads that mask as 0/1 instead (documents attend
to each other, silently), so the collator refuses to build batches while the packing patches are
not live in the process that will run the model. Needs only torch (no Transformers import).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Sequence, Union

import torch
from torch.utils.data import get_worker_info

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
    - ``position_ids``: 0, 1, ... restarting at each document, 0 on padding;
    - ``num_tokens`` (with ``return_num_tokens=True``): ``[rows]``, the real (non-padding) tokens
      of each row; ``batch["num_tokens"].sum()`` is the batch's token count. Summing the indexed
      mask instead counts document numbers (TRL's ``num_tokens`` metric does that). Per row, it
      stays right when a batch is split along its rows (Accelerate's ``split_batches``). Off by
      default: under ``Trainer`` every batch key reaches ``model(**batch)``; Transformers 5.x
      models take it in ``**kwargs`` and ignore it, but some 4.x forwards (bloom, bart, mbart,
      pegasus, ... on 4.57) raise on an unknown keyword.

    Documents longer than ``max_length`` are truncated (``overlong="truncate"``) or cut into
    ``max_length`` pieces that become separate documents (``"split"``), with a logged warning;
    ``"error"`` raises instead. Empty documents are dropped with a warning.

    Stock Transformers (no :func:`model_patches.enable_packing`) reads the indexed mask as 0/1 on
    every attention backend, so documents would attend to each other without an error. A call
    therefore raises ``ValueError`` unless the packing patches are live
    (:func:`model_patches.packing.enable.packing_enabled`) in the process that runs the model:
    this one, or, in a DataLoader worker started with ``spawn``/``forkserver``, the process that
    sent the collator there (its state is captured when the collator is pickled; ``fork``
    workers inherit it). ``require_packing=False`` turns the check off, for batches that never
    reach an unpatched model (counting tokens, writing batches for another process).
    """

    def __init__(
        self,
        max_length: int,
        *,
        pad_token_id: int = 0,
        overlong: str = "truncate",
        label_pad_id: int = -100,
        require_packing: bool = True,
        return_num_tokens: bool = False,
    ) -> None:
        if not isinstance(max_length, int) or max_length <= 0:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        if overlong not in ("truncate", "split", "error"):
            raise ValueError(f"overlong must be 'truncate', 'split' or 'error', got {overlong!r}")
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.overlong = overlong
        self.label_pad_id = label_pad_id
        self.require_packing = require_packing
        self.return_num_tokens = return_num_tokens

    def __getstate__(self) -> dict[str, Any]:
        # Sent to a spawned DataLoader worker: the model runs here, so this process's state counts.
        state = dict(self.__dict__)
        state["_sender"] = (os.getpid(), _packing_enabled()) if self.require_packing else None
        return state

    def _check_packing(self) -> None:
        # In a DataLoader worker that unpickled this collator, the model runs in the sender.
        sender = self.__dict__.get("_sender")
        in_worker = sender is not None and sender[0] != os.getpid() and get_worker_info() is not None
        if (sender[1] if in_worker else _packing_enabled()):
            return
        where = (
            "in the process that sent this collator to its DataLoader worker (spawn/forkserver), "
            "when the DataLoader started iterating" if in_worker else "in this process"
        )
        raise ValueError(
            f"PackingCollator: the packing patches are not active {where}. Stock Transformers reads "
            "the indexed attention_mask (1, 2, ... per document) as 0/1, so packed documents would "
            "attend to each other on every attention backend (eager, sdpa, flex_attention, "
            "flash_attention_2/3) without any error. Fix: call model_patches.enable_packing() (or "
            "enable_packing(model=model)) before the first batch and keep its handle alive while "
            "training (with spawn workers: before iterating the DataLoader). If these batches never "
            "reach a model without the patches (counting tokens, saving them), pass "
            "PackingCollator(..., require_packing=False)"
        )

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
        if self.require_packing:
            self._check_packing()
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
        batch = {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "position_ids": positions}
        if self.return_num_tokens:
            batch["num_tokens"] = (mask != 0).sum(dim=1)
        return batch

    @staticmethod
    def efficiency(batch: Mapping[str, torch.Tensor]) -> float:
        """Real tokens / row slots of a collated batch (``num_tokens`` where the batch has it)."""
        mask = batch["attention_mask"]
        tokens = batch["num_tokens"].sum() if "num_tokens" in batch else (mask != 0).sum()
        return float(tokens) / float(mask.numel())


def _packing_enabled() -> bool:
    from .enable import packing_enabled  # the registry's state; imports no Transformers

    return packing_enabled()

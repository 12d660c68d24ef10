"""What each process of the context-parallel tests runs: a tiny model trained on packed rows with
the sequence sharded over the group, against the same model trained on one process."""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.distributed as dist

import model_patches
from tests.support.tiny_models import tiny_ac_model


def packed_rows(rows: int, tokens: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of documents with log-normal lengths (median 24 tokens) packed back to back, the last
    one cut at the row's end: ``input_ids``, ``labels`` (the ids; -100 on each document's first
    token) and ``position_ids`` (from 0 in each document)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, tokens), generator=g)
    positions = torch.empty_like(ids)
    for r in range(rows):
        t = 0
        while t < tokens:
            n = int(torch.exp(torch.randn((), generator=g) * 0.8 + 3.2).clamp(2, tokens))
            n = min(n, tokens - t)
            positions[r, t:t + n] = torch.arange(n)
            t += n
    labels = ids.clone()
    labels[positions == 0] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _model(family: str, attention: str, seed: int) -> torch.nn.Module:
    model = tiny_ac_model(family, seed=seed, use_cache=False)
    model.config._attn_implementation = attention
    return model


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def train_steps(mesh: Optional[Any], family: str, attention: str, steps: int, tokens: int,
                seed: int = 0, linear_loss: bool = False) -> Optional[dict[str, Any]]:
    """``steps`` optimizer steps on one packed batch per step: one process (the reference, every rank
    computes it) and context-parallel over the mesh. Returns both runs' losses and final gradients
    and weights."""
    if mesh is None:
        return None
    torch.manual_seed(seed)
    reference = _model(family, attention, seed)
    sharded = copy.deepcopy(reference)
    if linear_loss:  # the hidden-state loss on both
        model_patches.enable_linear_cross_entropy(reference)
        model_patches.enable_linear_cross_entropy(sharded)
    group = mesh.get_group()
    cp = model_patches.enable_context_parallel(sharded, group)
    # SGD with momentum: AdamW divides each gradient by its own running size, so an entry whose
    # gradient is round-off on both sides can move by the learning rate on one and not the other
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    opt_cp = torch.optim.SGD(sharded.parameters(), lr=0.5, momentum=0.9)
    vocab = reference.config.vocab_size
    losses_ref, losses_cp = [], []
    for step in range(steps):
        batch = packed_rows(2, tokens, vocab, seed=seed + step)
        opt_ref.zero_grad(set_to_none=True)
        loss = reference(**batch).loss
        loss.backward()
        losses_ref.append(loss.detach())
        opt_cp.zero_grad(set_to_none=True)
        local = sharded(**cp.shard(batch)).loss
        local.backward()
        for p in sharded.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
        total = local.detach().clone()
        dist.all_reduce(total, group=group)
        losses_cp.append(total)
        grads_ref, grads_cp = _grads(reference), _grads(sharded)
        opt_ref.step()
        opt_cp.step()
    cp.remove()
    return {"losses": (torch.stack(losses_ref), torch.stack(losses_cp)), "grads": (grads_ref, grads_cp),
            "weights": ({n: p.detach().clone() for n, p in reference.named_parameters()},
                        {n: p.detach().clone() for n, p in sharded.named_parameters()}),
            "implementation": sharded.config._attn_implementation}


def perturbed_document(mesh: Optional[Any], family: str, attention: str, tokens: int) -> Optional[dict[str, Any]]:
    """The whole row's logits (unsharded on every rank) before and after changing the tokens of one
    document that crosses a shard boundary."""
    if mesh is None:
        return None
    model = _model(family, attention, 0)
    cp = model_patches.enable_context_parallel(model, mesh.get_group())
    batch = packed_rows(1, tokens, model.config.vocab_size, seed=3)
    docs = model_patches.context_parallel.document_ids(batch["position_ids"])
    victim = int(torch.bincount(docs[0]).argmax())  # the longest document: its pieces are on every rank
    changed = {k: v.clone() for k, v in batch.items()}
    where = docs[0] == victim
    changed["input_ids"][0, where] = (changed["input_ids"][0, where] + 1) % model.config.vocab_size
    with torch.no_grad():
        before = cp.unshard(model(**cp.shard(batch)).logits)
        after = cp.unshard(model(**cp.shard(changed)).logits)
    cp.remove()
    return {"before": before, "after": after, "victim": where, "victim_tokens": int(where.sum())}

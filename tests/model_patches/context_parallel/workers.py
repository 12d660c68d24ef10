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


def _model(family: str, attention: str, seed: int, **overrides: Any) -> torch.nn.Module:
    model = tiny_ac_model(family, seed=seed, use_cache=False, **overrides)
    model.config._attn_implementation = attention
    return model


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def train_steps(mesh: Optional[Any], family: str, attention: str, steps: int, tokens: int,
                seed: int = 0, linear_loss: bool = False, router_loss: bool = False,
                config: Optional[dict[str, Any]] = None, mask_elements: int = 1 << 26,
                policy: Optional[str] = None, sharded_attention: Optional[str] = None) -> Optional[dict[str, Any]]:
    """``steps`` optimizer steps on one packed batch per step: one process (the reference, every rank
    computes it) and context-parallel over the mesh (``router_loss``: a MoE model's load-balancing
    loss on, with the packing patch; ``config``: more config fields; ``mask_elements``: as
    ``enable_context_parallel`` takes it; ``policy``: an ``ac_policies`` preset on both;
    ``sharded_attention``: the context-parallel run's attention, when not the reference's). Returns
    both runs' losses and final gradients and weights."""
    if mesh is None:
        return None
    torch.manual_seed(seed)
    packing = model_patches.enable_packing() if router_loss else None
    reference = _model(family, attention, seed, **(config or {}),
                       **({"output_router_logits": True} if router_loss else {}))
    sharded = copy.deepcopy(reference)
    if sharded_attention is not None:
        from model_patches.testing.flash_double import use_attention

        use_attention(sharded, sharded_attention)
    if linear_loss:  # the hidden-state loss on both
        model_patches.enable_linear_cross_entropy(reference)
        model_patches.enable_linear_cross_entropy(sharded)
    if policy is not None:
        import warnings

        import ac_policies

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
            ac_policies.apply_policy(reference, policy)
            ac_policies.apply_policy(sharded, policy)
    group = mesh.get_group()
    cp = model_patches.enable_context_parallel(sharded, group, mask_elements=mask_elements)
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
    if packing is not None:
        packing.remove()
    return {"losses": (torch.stack(losses_ref), torch.stack(losses_cp)), "grads": (grads_ref, grads_cp),
            "weights": ({n: p.detach().clone() for n, p in reference.named_parameters()},
                        {n: p.detach().clone() for n, p in sharded.named_parameters()}),
            "implementation": sharded.config._attn_implementation}


def perturbed_document(mesh: Optional[Any], family: str, attention: str, tokens: int,
                       config: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """The whole row's logits (unsharded on every rank) before and after changing the tokens of one
    document that crosses a shard boundary (``config``: more config fields)."""
    if mesh is None:
        return None
    model = _model(family, attention, 0, **(config or {}))
    cp = model_patches.enable_context_parallel(model, mesh)  # the mesh itself, as mesh["cp"] is passed
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


def accumulated_step(mesh: Optional[Any], family: str, tokens: int) -> Optional[dict[str, Any]]:
    """One step of 2 accumulated micro-batches: context-parallel (each micro-batch's loss over the
    step's label count, passed to ``shard``) against one process on the 2 micro-batches as one batch.
    Returns both losses and gradients."""
    if mesh is None:
        return None
    reference = _model(family, "sdpa", 0)
    sharded = copy.deepcopy(reference)
    group = mesh.get_group()
    cp = model_patches.enable_context_parallel(sharded, group)
    vocab = reference.config.vocab_size
    micro = [packed_rows(1, tokens, vocab, seed=10 + i) for i in range(2)]
    whole = {k: torch.cat([m[k] for m in micro]) for k in micro[0]}
    loss_ref = reference(**whole).loss
    loss_ref.backward()
    count = sum(int((m["labels"][:, 1:] != -100).sum()) for m in micro)
    total = torch.zeros(())
    for m in micro:
        local = sharded(**cp.shard(m, num_items_in_batch=count)).loss
        local.backward()
        total += local.detach()
    dist.all_reduce(total, group=group)
    for p in sharded.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    cp.remove()
    return {"losses": (loss_ref.detach(), total), "grads": (_grads(reference), _grads(sharded))}


def fsdp_cp_step(mesh: Optional[Any], family: str, tokens: int) -> Optional[dict[str, Any]]:
    """One step on a (dp, cp) mesh: FSDP2 over all its processes, context parallelism over ``cp``,
    one packed batch per ``dp`` replica; the loss over the step's label count, multiplied by the
    processes FSDP2 averages over. Against one process on both batches as one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    if mesh is None:
        return None
    reference = _model(family, "sdpa", 0)
    sharded = copy.deepcopy(reference)
    cp = model_patches.enable_context_parallel(sharded, mesh["cp"].get_group())
    everyone = init_device_mesh("cpu", (mesh.size(),))
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=everyone)
    fully_shard(sharded, mesh=everyone)
    vocab = reference.config.vocab_size
    batches = [packed_rows(1, tokens, vocab, seed=20 + i) for i in range(mesh["dp"].size())]
    whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    loss_ref = reference(**whole).loss
    loss_ref.backward()
    count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    mine = batches[mesh["dp"].get_local_rank()]
    local = sharded(**cp.shard(mine, num_items_in_batch=count)).loss
    (local * mesh.size()).backward()  # FSDP2 averages the gradients over every process
    total = local.detach().clone()
    dist.all_reduce(total)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for n, p in sharded.named_parameters() if p.grad is not None}
    cp.remove()
    return {"losses": (loss_ref.detach(), total), "grads": (_grads(reference), grads)}


def blocked_peaks(mesh: Optional[Any], tokens: int, mask_elements: int) -> Optional[dict[str, Any]]:
    """One process's measured step peak (live tensors) and kept activations on a packed row of
    ``tokens``, the attention whole (one block) and in blocks of ``mask_elements // tokens`` queries."""
    from ac_policies.estimate import measure_step

    if mesh is None:
        return None
    out = {}
    for name, elements in (("whole", 1 << 40), ("blocks", mask_elements)):
        model = _model("llama", "sdpa", 0)
        cp = model_patches.enable_context_parallel(model, mesh.get_group(), mask_elements=elements)
        local = cp.shard(packed_rows(1, tokens, model.config.vocab_size, seed=5))
        step = measure_step(model, lambda m: m(**local).loss, optimizer=None)
        cp.remove()
        out[name] = {"peak": step.peak, "activations": step.activations}
    return out


def estimated_and_measured(mesh: Optional[Any], policy: str, tokens: int,
                           mask_elements: Optional[int] = None) -> Optional[dict[str, Any]]:
    """One process's step of a packed row of ``tokens`` sharded over the mesh: measured on live
    tensors (``measure_step``, the real gathers) and estimated on fake tensors without a process
    group (``estimate(context_parallel=world)``), the model with checkpointing ``policy``
    (``mask_elements``: both runs' attention blocks, in place of the default)."""
    from ac_policies.estimate import estimate, measure_step
    from model_patches.context_parallel import enable
    from tests.ac_policies.estimate.workers.fsdp_estimate import prepared_model

    if mesh is None:
        return None
    if mask_elements is not None:
        enable.MASK_ELEMENTS = mask_elements  # this worker process's default, for both runs
    model = prepared_model("llama", policy, False, use_cache=False)
    model.config._attn_implementation = "sdpa"
    vocab = model.config.vocab_size
    cp = model_patches.enable_context_parallel(model, mesh.get_group())
    local = cp.shard(packed_rows(1, tokens, vocab, seed=5))
    measured = measure_step(model, lambda m: m(**local).loss, optimizer=None)
    cp.remove()
    width = local["input_ids"].shape[1]

    def step(m: torch.nn.Module) -> torch.Tensor:  # this process's shard, as plain ids (fake in the trace)
        ids = torch.randint(0, vocab, (1, width))
        return m(input_ids=ids, labels=ids).loss

    estimated = estimate(model, step, optimizer=None, context_parallel=mesh.size())
    whole = estimate(model, lambda m: m(input_ids=(ids := torch.randint(0, vocab, (1, tokens))), labels=ids).loss,
                     optimizer=None)
    enable.MASK_ELEMENTS = 1 << 26
    return {"measured": measured.peak, "estimated": estimated.peak, "whole": whole.peak,
            "fixed": measured.params + measured.buffers, "text": str(estimated)}


def library_losses(mesh: Optional[Any], tokens: int) -> Optional[dict[str, Any]]:
    """The library's losses on a shard against one process on the whole row: token log-probs and
    entropies (``unshard`` to the row), the distillation loss (its mean: this shard's sum over the
    batch's count, ``num_items_in_batch``) summed over the group, and the loss
    of ``enable_chunked_loss`` summed over the group, each with its one-process value."""
    if mesh is None:
        return None
    group = mesh.get_group()
    student, teacher = _model("llama", "sdpa", 0), _model("llama", "sdpa", 1)
    batch = packed_rows(2, tokens, student.config.vocab_size, seed=7)
    out: dict[str, Any] = {}
    with torch.no_grad():
        whole = model_patches.causal_lm_token_logprobs(student, return_entropy=True, **batch)
        whole_kd = model_patches.causal_lm_distillation_loss(student, teacher, **batch)
        chunked = model_patches.enable_chunked_loss(model=student)
        whole_chunked = student(**batch).loss
        chunked.remove()
        cps = [model_patches.enable_context_parallel(m, group) for m in (student, teacher)]
        local = cps[0].shard(batch)
        logp, entropy = model_patches.causal_lm_token_logprobs(student, return_entropy=True, **local)
        out["logprobs"] = (cps[0].unshard(logp)[:, :-1], whole[0][:, :-1])
        out["entropy"] = (cps[0].unshard(entropy)[:, :-1], whole[1][:, :-1])
        kd = model_patches.causal_lm_distillation_loss(student, teacher, **local)
        chunked = model_patches.enable_chunked_loss(model=student)
        loss = student(**local).loss
        chunked.remove()
        for t in (kd, loss):
            dist.all_reduce(t, group=group)
        out["distillation"], out["chunked"] = (kd, whole_kd), (loss, whole_chunked)
        for cp in cps:
            cp.remove()
    return out


def flex_forward(mesh: Optional[Any], tokens: int) -> Optional[dict[str, Any]]:
    """Forward only (flex attention has no backward on CPU): the whole rows' logits of one process
    (the packing patch's flex mask) and of the context-parallel processes (put back in row order),
    and the latter again after one document's tokens changed."""
    if mesh is None:
        return None
    # Each shape compiles on its own: torch 2.13's CPU flex kernel fails to build once dynamo
    # recompiles it for dynamic shapes (C++ "cur_kvSplitSize was not declared").
    torch._dynamo.config.automatic_dynamic_shapes = False
    handle = model_patches.enable_packing()
    model = _model("llama", "flex_attention", 0).eval()
    batch = packed_rows(1, tokens, model.config.vocab_size, seed=3)
    inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
    docs = model_patches.context_parallel.document_ids(batch["position_ids"])
    victim = docs[0] == int(torch.bincount(docs[0]).argmax())
    changed = dict(inputs, input_ids=torch.where(victim, (inputs["input_ids"] + 1) % model.config.vocab_size,
                                                 inputs["input_ids"]))
    with torch.no_grad():
        whole = model(**inputs).logits
        cp = model_patches.enable_context_parallel(model, mesh.get_group())
        sharded = cp.unshard(model(**cp.shard(inputs)).logits)
        after = cp.unshard(model(**cp.shard(changed)).logits)
        cp.remove()
    handle.remove()
    return {"whole": whole, "sharded": sharded, "after": after, "victim": victim}


def on_cpu_flash(mesh: Optional[Any], worker: str, *args: Any) -> Optional[dict[str, Any]]:
    """``worker`` (a function of this module) with Transformers' FlashAttention kernels routed to the
    CPU test double (per-sequence SDPA with flash's bottom-right causal alignment)."""
    from model_patches.testing import cpu_flash_attention

    with cpu_flash_attention():
        return globals()[worker](mesh, *args)

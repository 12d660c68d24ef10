"""RL log-probs and distillation of stock ``*ForCausalLM`` models, computed from hidden states.

``causal_lm_token_logprobs(model, **batch)`` gives each position's log-probability of its label
(and optionally the entropy) under the model's tempered distribution, for policy-gradient losses
(PPO, GRPO, ...). ``causal_lm_distillation_loss(student, teacher, **batch)`` gives the
generalized Jensen-Shannon divergence of TRL's GKD between the two models. Both run the models'
decoders, then :func:`functional_ce.linear_token_logprobs` /
:func:`functional_ce.linear_distillation_loss` on the output-embedding weights, so the
``[B, T, V]`` logits are never built.

They fit the models :func:`model_patches.causal_lm_loss` fits and refuse the heads it refuses
(same checks, same messages); the label shift, ``shift_labels`` and ``ignore_index`` are
Transformers' ``ForCausalLMLoss`` ones. Router auxiliary losses of MoE models are not part of
either quantity and are not added.

FSDP2: a model sharded with ``fully_shard`` runs inside its root's own call (and a separately
sharded ``lm_head`` inside the head's call), as in ``causal_lm_loss``, so FSDP2's hooks gather
and reshard its parameters and reduce its gradients as for ``model(**batch)``. The teacher's
calls are entered with gradients off, so FSDP2 registers no backward work for it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

import functional_ce
from functional_ce.spec import ChunkSize

from .causal_lm_parts import (
    decoder_inputs,
    head_and_decoder,
    inside_call,
    is_fsdp_module,
    last_hidden_state,
    shifted_labels,
)

__all__ = ["causal_lm_distillation_loss", "causal_lm_token_logprobs"]

logger = logging.getLogger(__name__)


def _in_call(module: nn.Module, fn: Callable[[], Any], *, frozen: bool = False) -> Any:
    """``fn()``, inside ``module``'s own call when FSDP2 sharded it (see
    :func:`model_patches.loss.causal_lm_parts.inside_call`). ``frozen``: FSDP2's hooks run with
    gradients off (no backward hooks for ``module``) while ``fn`` keeps the caller's grad mode."""
    if not is_fsdp_module(module):
        return fn()
    grad_mode = torch.is_grad_enabled()

    def run() -> Any:
        with torch.set_grad_enabled(grad_mode):
            out = fn()
        # FSDP2 hooks its backward onto the returned tensors; an in-place op on a returned view
        # would drop that hook (FSDP2 warns), so views leave the call as copies (O(B * T) here).
        if isinstance(out, tuple):
            return tuple(_not_a_view(t) for t in out)
        return _not_a_view(out)

    with torch.set_grad_enabled(grad_mode and not frozen):
        return inside_call(module, run)


def _not_a_view(t: Any) -> Any:
    return t.clone() if isinstance(t, torch.Tensor) and t._base is not None else t


def _as_weight_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden`` in the head weight's dtype (e.g. an fp32 final norm under autocast)."""
    return hidden.to(weight.dtype) if hidden.dtype != weight.dtype else hidden


def _labels_of(batch: dict[str, Any], who: str) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    labels, shift_labels = batch.get("labels"), batch.get("shift_labels")
    if labels is None and shift_labels is None:
        raise ValueError(
            f"{who} needs labels=[B, T] or shift_labels=[B, T] in the batch, got neither "
            "(pass labels=input_ids to score every token of the rows)"
        )
    return labels, shift_labels


def causal_lm_token_logprobs(
    model: nn.Module,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: ChunkSize = "auto",
    compile_chunks: Optional[bool] = None,
    **batch: Any,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Per-token ``log_softmax(logits / temperature)[label]`` of a causal LM, without logits.

    The model's ``final_logit_softcapping`` (Gemma 2/3) is applied to the logits first, then the
    temperature, as a sampler with that temperature sees them.

    Args:
        model: a Hugging Face ``*ForCausalLM`` that :func:`model_patches.causal_lm_loss` fits.
        temperature: the logits are divided by it (after the soft-cap).
        return_entropy: also return the entropy of the same tempered distribution.
        chunk_size, compile_chunks: passed to :func:`functional_ce.linear_token_logprobs`.
        **batch: what you would pass to ``model(...)`` (``input_ids`` or ``inputs_embeds``,
            ``attention_mask``, ``position_ids``, ...) and ``labels`` ``[B, T]`` (unshifted:
            position t scores label t+1 and the last position scores nothing) or ``shift_labels``
            ``[B, T]`` (already aligned); optionally ``ignore_index`` (default -100).
            ``use_cache`` defaults to False.

    Returns:
        ``logp`` fp32 ``[B, T]``, 0 where the (shifted) label is ignored; with
        ``return_entropy``, ``(logp, entropy)``, both fp32 ``[B, T]``, entropy 0 there too.
        Differentiable with respect to the model's parameters.

    Raises:
        ValueError: a model whose head cannot be reproduced (see ``causal_lm_loss``), or a batch
            without ``labels``/``shift_labels``.
    """
    who = "causal_lm_token_logprobs"
    head, decoder = head_and_decoder(model, who)
    labels, shift_labels = _labels_of(batch, who)
    ignore_index = int(batch.get("ignore_index", -100))
    softcap = getattr(model.config, "final_logit_softcapping", None)
    inputs = decoder_inputs(batch)

    def step() -> Any:
        hidden = last_hidden_state(decoder, inputs)
        targets = shifted_labels(labels, shift_labels, ignore_index, hidden.device)

        def head_logprobs() -> Any:
            weight = head.weight  # the gathered parameter inside an FSDP2 head's call
            return functional_ce.linear_token_logprobs(
                _as_weight_dtype(hidden, weight), weight, targets, bias=head.bias, temperature=temperature,
                softcap=softcap, ignore_index=ignore_index, return_entropy=return_entropy,
                chunk_size=chunk_size, compile_chunks=compile_chunks,
            )

        return _in_call(head, head_logprobs)

    return _in_call(model, step)


def _counted_positions(inputs: dict[str, Any], like: torch.Tensor, who: str) -> torch.Tensor:
    """bool ``[B, T]``: positions t whose next token t+1 is real (attention mask nonzero; every
    token without a mask); the last position never counts."""
    b, t = like.shape[:2]
    attention_mask = inputs.get("attention_mask")
    if attention_mask is None:
        real = torch.ones(b, t, dtype=torch.bool, device=like.device)
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        real = attention_mask.to(like.device) != 0
    else:
        raise ValueError(
            f"{who}: without labels the counted tokens come from a 2D attention_mask [B, T], got "
            f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}; pass labels or shift_labels"
        )
    return F.pad(real[:, 1:], (0, 1), value=False)


def causal_lm_distillation_loss(
    student: nn.Module,
    teacher: nn.Module,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "mean",
    chunk_size: ChunkSize = "auto",
    compile_chunks: Optional[bool] = None,
    teacher_batch: Optional[dict[str, Any]] = None,
    **batch: Any,
) -> torch.Tensor:
    """TRL GKD's generalized Jensen-Shannon divergence of ``student`` from ``teacher``, without logits.

    ``beta=0``: KL(teacher || student); ``beta=1``: KL(student || teacher); otherwise
    ``beta * KL(t || m) + (1 - beta) * KL(s || m)`` with ``m = beta * p_t + (1 - beta) * p_s``;
    each model's logits are soft-capped with its own ``config.final_logit_softcapping`` (Gemma
    2/3; none where it is None), then both are divided by ``temperature`` (no ``T**2`` factor), as
    TRL's ``DistillationTrainer`` does. Position t
    compares the two models' next-token distributions; the tokens counted are those whose
    shifted label is not ``ignore_index`` when the batch has ``labels``/``shift_labels``,
    otherwise those where the attention mask (shifted the same way) is nonzero, every position
    but the last without one. The teacher's decoder runs under ``torch.no_grad()`` and its head
    gets no gradient.

    Args:
        student: the model trained, a ``*ForCausalLM`` :func:`model_patches.causal_lm_loss` fits.
        teacher: the same kind of model with the same vocabulary size (its hidden size may differ).
        beta, temperature, reduction: as :func:`functional_ce.linear_distillation_loss`
            (``"mean"`` over counted tokens, ``"sum"``, ``"none"``).
        chunk_size, compile_chunks: passed to :func:`functional_ce.linear_distillation_loss`.
        teacher_batch: the teacher's model inputs when they differ from the student's (e.g. a
            longer prompt left out); its rows must have the student's ``[B, T]``. Default: the
            batch's own model inputs.
        **batch: the student's ``model(...)`` inputs, optionally ``labels`` ``[B, T]``
            (unshifted) or ``shift_labels`` ``[B, T]``, ``num_items_in_batch`` (divide the summed
            loss by this count instead) and ``ignore_index`` (default -100).

    Returns:
        fp32 scalar, or fp32 ``[B, T]`` per token with ``reduction="none"`` (0 where not counted).

    Raises:
        ValueError: a model whose head cannot be reproduced, vocabulary sizes that differ, or
            teacher rows whose shape differs from the student's.
    """
    who = "causal_lm_distillation_loss"
    s_head, s_decoder = head_and_decoder(student, who)
    t_head, t_decoder = head_and_decoder(teacher, who)
    if s_head.out_features != t_head.out_features:
        raise ValueError(
            f"{who}: the student's vocabulary has {s_head.out_features} entries and the teacher's "
            f"{t_head.out_features}; both heads must score the same vocabulary (same tokenizer and size)"
        )
    logger.debug("%s: student %s (hidden %d), teacher %s (hidden %d), vocabulary %d", who, type(student).__name__,
                 s_head.in_features, type(teacher).__name__, t_head.in_features, s_head.out_features)
    s_softcap, t_softcap = (getattr(m.config, "final_logit_softcapping", None) for m in (student, teacher))
    labels, shift_labels = batch.get("labels"), batch.get("shift_labels")
    ignore_index = int(batch.get("ignore_index", -100))
    num_items = batch.get("num_items_in_batch")
    inputs = decoder_inputs(batch)
    t_inputs = inputs if teacher_batch is None else decoder_inputs(teacher_batch)

    def teacher_hidden() -> torch.Tensor:
        with torch.no_grad():
            return last_hidden_state(t_decoder, t_inputs)

    def step() -> torch.Tensor:  # inside the student's call
        s_hidden = last_hidden_state(s_decoder, inputs)
        # The loss needs both heads at once, so it runs inside the teacher's call too.
        return _in_call(teacher, lambda: with_teacher(s_hidden, teacher_hidden()), frozen=True)

    def with_teacher(s_hidden: torch.Tensor, t_hidden: torch.Tensor) -> torch.Tensor:
        if s_hidden.shape[:-1] != t_hidden.shape[:-1]:
            raise ValueError(
                f"{who}: the student's rows are {tuple(s_hidden.shape[:-1])} and the teacher's "
                f"{tuple(t_hidden.shape[:-1])}; teacher_batch must have the student's [B, T]"
            )
        t_hidden = t_hidden.to(s_hidden.device)
        if labels is None and shift_labels is None:
            targets, mask = None, _counted_positions(inputs, s_hidden, who)
        else:
            targets, mask = shifted_labels(labels, shift_labels, ignore_index, s_hidden.device), None
        count = num_items.to(s_hidden.device) if isinstance(num_items, torch.Tensor) else num_items

        def heads_loss() -> torch.Tensor:
            s_weight, t_weight = s_head.weight, t_head.weight  # gathered inside FSDP2 head calls
            return functional_ce.linear_distillation_loss(
                _as_weight_dtype(s_hidden, s_weight), s_weight,
                _as_weight_dtype(t_hidden, t_weight).detach(), t_weight.detach(),
                student_bias=s_head.bias, teacher_bias=None if t_head.bias is None else t_head.bias.detach(),
                labels=targets, mask=mask, beta=beta, temperature=temperature, softcap=s_softcap,
                teacher_softcap=t_softcap, ignore_index=ignore_index,
                reduction=reduction, num_label_tokens=count, chunk_size=chunk_size, compile_chunks=compile_chunks,
            )

        return _in_call(s_head, lambda: _in_call(t_head, heads_loss, frozen=True))

    return _in_call(student, step)

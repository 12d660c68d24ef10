"""The computations behind TRL's routed heads: TRL's fused-head and chunked-divergence contracts
on :func:`functional_ce.linear_token_logprobs` and :func:`functional_ce.linear_distillation_loss`.

:mod:`model_patches.loss.trl_heads` installs them in TRL's place; this module only computes.

DeepSpeed ZeRO-3: TRL reads the partitioned head's weight inside the model's forward, which
DeepSpeed's engine runs with its discovery of external parameters on: the read gathers the weight
and registers it with the module whose forward is under way (the model), so ZeRO-3 releases it
after that forward, gathers it again before that module's backward (where functional_ce's
backward reads it) and reduces its gradient as for any parameter, once per step. A ZeRO-3 weight
that no forward under way holds that way is refused (:func:`_zero3_weight_held`): it would be
released before the backward.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

import functional_ce

from .unused_loss_watch import loss_reached

__all__ = ["OPTIONAL_OUTPUTS", "routed_divergence", "routed_logprobs"]

#: TRL's per-token outputs besides the log-probs, in the order its kernel returns them.
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _zero3_weight_held(weight: Any, who: str) -> None:
    """Raise ``ValueError`` for a DeepSpeed ZeRO-3 parameter that no module forward under way owns
    or holds as an external parameter (ZeRO-3 would not gather it again for the backward)."""
    if getattr(weight, "ds_id", None) is None:
        return
    from deepspeed.runtime.zero.parameter_offload import FWD_MODULE_STACK
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    # The stack's first entry is the engine's root, pushed once when the engine was built; the stack
    # also keeps entries of engines built before in the process, so a weight not gathered now is
    # refused whatever the stack holds.
    held = weight.ds_status != ZeroParamStatus.NOT_AVAILABLE
    for module in FWD_MODULE_STACK[1:] if held else ():
        if id(weight) in getattr(module, "_external_params", {}) or any(
                p is weight for p in module.parameters(recurse=False)):
            return
    raise ValueError(
        f"{who} on functional_ce got a DeepSpeed ZeRO-3 LM head weight (ds_id={weight.ds_id}, "
        f"{weight.ds_status}) that no module forward under way holds, so ZeRO-3 would release it before "
        "the backward. Call the model through its DeepSpeed engine (engine(**batch), as the trainers do), "
        "or remove the enable_trl_heads handle to use TRL's own kernel"
    )


def _compute_inputs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple:
    """``(weight, bias)`` in the dtype TRL computes in: the autocast dtype under autocast (then
    functional_ce casts all three), else the hidden states' (``cast_lm_head_to_fp32`` passes fp32
    hidden states with the model's bf16 head; TRL casts each weight chunk, this casts once)."""
    if torch.is_autocast_enabled(hidden.device.type) or weight.dtype == hidden.dtype:
        return weight, bias
    return weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)


def routed_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                    temperature: float, chunk_size: int, final_logit_softcapping: Optional[float] = None,
                    logit_scale: float = 1.0, outputs: Sequence[str] = OPTIONAL_OUTPUTS) -> tuple:
    """TRL's ``ChunkedLogProbFunction.apply`` contract on :func:`functional_ce.linear_token_logprobs`:
    ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, fp32 (``is_top1`` bool),
    None for each field not in ``outputs``; gradients on the log-probs and the entropy only.
    ``chunk_size`` (TRL's vocabulary tile width) is not used: functional_ce chunks token rows."""
    loss_reached()
    outputs = tuple(outputs)
    entropy = "entropy" in outputs
    stats = tuple(name for name in OPTIONAL_OUTPUTS[1:] if name in outputs)
    _zero3_weight_held(weight, "TRL's fused LM head")
    weight, bias = _compute_inputs(hidden, weight, bias)
    result = functional_ce.linear_token_logprobs(
        hidden, weight, targets, bias=bias, temperature=float(temperature), softcap=final_logit_softcapping,
        logit_scale=float(logit_scale), return_entropy=entropy, stats=stats,
    )
    values = dict(zip(("log_probs", *(("entropy",) if entropy else ()), *stats),
                      result if isinstance(result, tuple) else (result,)))
    return tuple(values.get(name) for name in ("log_probs", *OPTIONAL_OUTPUTS))


def _full(weight: Any, bias: Any, dtype: torch.dtype) -> tuple:
    """TRL's own handling of an FSDP2 head: the full weight (in ``dtype``) and bias."""
    if isinstance(weight, torch.distributed.tensor.DTensor):
        weight = weight.full_tensor().to(dtype)
        if bias is not None:
            bias = bias.full_tensor()
    return weight, bias


def routed_divergence(student_hidden_states: torch.Tensor, teacher_hidden_states: torch.Tensor,
                      student_lm_head_weight: torch.Tensor, teacher_lm_head_weight: torch.Tensor,
                      completion_mask: torch.Tensor, beta: float, num_items_in_batch: Any = None,
                      student_lm_head_bias: Optional[torch.Tensor] = None,
                      teacher_lm_head_bias: Optional[torch.Tensor] = None, student_logit_scale: float = 1.0,
                      teacher_logit_scale: float = 1.0, student_final_logit_softcapping: Optional[float] = None,
                      teacher_final_logit_softcapping: Optional[float] = None, temperature: float = 1.0) -> tuple:
    """TRL's ``_chunked_divergence_loss`` contract on :func:`functional_ce.linear_distillation_loss`:
    ``(loss, student entropy sum, number of counted positions)``; the loss is the summed divergence
    over ``num_items_in_batch`` (over the counted positions, 0 when none, without it), its gradient
    reaches the student only; the entropy (of the tempered student distribution) has none.

    Each model's logit scale and soft-cap go to functional_ce as that model's own (TRL's order:
    scale, soft-cap, then temperature). The student's entropy is a second, gradient-free pass over
    the student's head with the student's scale and soft-cap (functional_ce's divergence does not
    return it).
    """
    loss_reached()
    _zero3_weight_held(student_lm_head_weight, "TRL's chunked divergence")
    ws, bs = _full(student_lm_head_weight, student_lm_head_bias, student_hidden_states.dtype)
    wt, bt = _full(teacher_lm_head_weight, teacher_lm_head_bias, teacher_hidden_states.dtype)
    valid = completion_mask.reshape(-1) != 0
    hs = student_hidden_states.reshape(-1, student_hidden_states.size(-1))
    ht = teacher_hidden_states.reshape(-1, teacher_hidden_states.size(-1))
    ws, bs = _compute_inputs(hs, ws, bs)
    wt, bt = _compute_inputs(ht, wt, bt)
    count = num_items_in_batch
    if isinstance(count, torch.Tensor):
        count = count.to(hs.device)
    student = dict(temperature=float(temperature), softcap=student_final_logit_softcapping,
                   logit_scale=float(student_logit_scale))
    loss = functional_ce.linear_distillation_loss(
        hs, ws, ht.detach(), wt.detach(), student_bias=bs, teacher_bias=None if bt is None else bt.detach(),
        mask=valid, beta=float(beta), teacher_softcap=teacher_final_logit_softcapping,
        teacher_logit_scale=float(teacher_logit_scale), reduction="mean", num_label_tokens=count, **student,
    )
    with torch.no_grad():
        _, entropy = functional_ce.linear_token_logprobs(
            hs, ws, torch.zeros_like(valid, dtype=torch.long), bias=bs, mask=valid, return_entropy=True, **student,
        )
    return loss, entropy.sum(), valid.sum()

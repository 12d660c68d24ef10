"""Per-token log-probabilities with entropy, and distillation, from logits and from hidden states.

The same chunk driver as cross-entropy runs them (:mod:`functional_ce.driver`); their chunk maths
is in :mod:`functional_ce.maths`. Their keyword options are declared once, on
:class:`~functional_ce.spec.LossSpec`; each function's signature lists them.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch

from . import operators
from .inputs import autocast_inputs, check_float, check_linear_inputs, make_spec
from .loss import gathered_head, is_dtensor
from .spec import keyword_signature

LogProbs = Union[torch.Tensor, tuple[torch.Tensor, ...]]


def _split(rows: torch.Tensor, options: dict[str, Any]) -> LogProbs:
    """``logp``, or ``(logp, [entropy], *stats)``: the extra statistics detached (no gradient),
    ``is_top1`` as bool."""
    return_entropy, stats = options.get("return_entropy", False), tuple(options.get("stats", ()))
    if not (return_entropy or stats):
        return rows
    first = 2 if return_entropy else 1
    # Copies of single columns, not unbind's views: unbind's backward stacks a plain zero tensor
    # for every output that got no gradient, which a DTensor result cannot mix with its DTensor
    # gradients; and compiled graphs with DTensor outputs refuse outputs that alias each other.
    # Each copy is O(N).
    kept = tuple(rows[..., i].clone() for i in range(first))
    extra = tuple(rows[..., first + i].detach().clone() for i in range(len(stats)))
    return (*kept, *(c > 0.5 if name == "is_top1" else c for name, c in zip(stats, extra)))


def _check_logits(name: str, logits: object) -> torch.Tensor:
    logits = check_float(name, logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"{name} must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    return logits


def _vocab_parallel(form: str, x: Any, weight: Any, bias: Any, labels: Any, options: dict[str, Any], loss: str,
                    **teacher: Any) -> torch.Tensor:
    from .distributed.vocab import vocab_parallel_loss

    return vocab_parallel_loss(form, x, weight, bias, labels, options, loss=loss, **teacher)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, **options: Any) -> LogProbs:
    """Each token's log-probability of its label (and the entropy) under ``softmax(z)``, in fp32.

    ``z = softcap * tanh(logits / softcap)`` (when ``softcap``), then ``z / temperature``. Same
    result as ``torch.log_softmax(z.float(), -1).gather(-1, labels[..., None])[..., 0]`` (TRL's
    ``selective_log_softmax``) and ``-(softmax(z) * log_softmax(z)).sum(-1)`` (its
    ``entropy_from_logits``, with ``0 * log 0 = 0``), without an ``[N, V]`` fp32 copy: forward and
    backward hold a few fp32 chunks of ``chunk_size x V`` and O(N) statistics. Any upstream
    gradient on the log-probs and on the entropy is exact (backward recomputes each chunk's
    softmax from the saved logsumexp).

    Args:
        logits: ``[..., V]`` float32, bfloat16 or float16, any strides.
        labels: ``[...]`` int64 or int32 class ids in ``[0, V)``, or ``ignore_index``.
        temperature: a finite number > 0 (default 1.0): the sampling temperature.
        softcap: None or a finite number > 0 (Gemma 2/3's final-logit softcap).
        ignore_index: label value whose outputs are 0 with zero gradient (default -100).
        mask: ``[...]`` bool or 0/1; zero positions are ignored like ``ignore_index``.
        return_entropy: also return the entropy of each token's distribution.
        logit_scale: a finite multiplier of the logits applied first, before the softcap
            (default 1.0; TRL's fused head's ``logit_scale``).
        stats: names from ``("is_top1", "log_sum_sq_probs", "mean_logits")`` (default none):
            extra per-token outputs, in the order named, none with a gradient: whether the label
            is the first arg-max of ``z`` (bool; a tie with an earlier class does not count),
            ``log(sum_v softmax(z)_v ** 2)`` (fp32) and ``z.mean(-1)`` (fp32). Each costs a
            reduction over the chunk's classes (the logits are built once for all of them).
        chunk_size, compile_chunks: as in :func:`functional_ce.cross_entropy`.

    Returns:
        ``logp`` fp32 ``[...]``, 0 where ignored; with ``return_entropy``, ``(logp, entropy)``;
        with ``stats``, ``(logp, [entropy], *stats)``; every output 0 (False) where ignored.

    Tensor parallel: ``logits`` may be a DTensor ``Shard(-1)`` over the vocabulary (as in
    :func:`functional_ce.cross_entropy`): forward all-reduces 12 bytes per token (16 with the
    entropy; 4 more for ``mean_logits``, 8 more each for ``log_sum_sq_probs`` and ``is_top1``),
    backward communicates nothing, and the outputs are DTensors ``Replicate()``.

    Raises:
        TypeError / ValueError: bad types, shapes, a temperature that is not finite and > 0, labels
            out of range (checked in eager mode only), or an unknown keyword.
    """
    logits = _check_logits("logits", logits)
    if is_dtensor(logits):
        rows = _vocab_parallel("logits", logits, None, None, labels, options, "token_logprobs")
        return _split(rows, options)
    n_classes = logits.shape[-1]
    spec, tokens = make_spec("logits", options, labels, loss="token_logprobs", batch_shape=logits.shape[:-1],
                             n_classes=n_classes, device=logits.device)
    rows = operators.loss_rows(logits.reshape(-1, n_classes), None, None, tokens, spec)
    return _split(rows, options)


def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          bias: Optional[torch.Tensor] = None, **options: Any) -> LogProbs:
    """:func:`token_logprobs` of the logits ``hidden @ weight.T + bias``, without ever building them.

    Each chunk of ``chunk_size`` token rows builds its ``[c, V]`` logits, its statistics, and drops
    them; rows whose label is ignored take part in no matmul. The upstream gradient is per token
    (an advantage, a ratio, an entropy bonus), so the gradients cannot be computed in forward:
    autograd saves ``hidden``, ``weight``, ``bias``, the labels and one or two fp32 values per row,
    and backward recomputes each chunk's logits (one more matmul per chunk than the logits path).
    The weight and bias gradients are accumulated in fp32 and returned in the weight's dtype.

    Args:
        hidden: ``[..., H]`` float32, bfloat16 or float16; weight ``[V, H]`` and bias ``[V]`` or
            None of its dtype and device. Under ``torch.autocast`` all three are cast first.
        labels: as in :func:`token_logprobs`.
        **options: ``temperature``, ``softcap``, ``logit_scale``, ``ignore_index``, ``mask``,
            ``return_entropy``, ``stats``, ``compile_chunks``: as in :func:`token_logprobs`;
            ``chunk_size`` as in :func:`functional_ce.linear_cross_entropy`.

    Returns:
        ``logp`` fp32 ``[...]`` (0 where ignored), ``(logp, entropy)`` with ``return_entropy``,
        ``(logp, [entropy], *stats)`` with ``stats``, as in :func:`token_logprobs`.

    Layouts as in :func:`functional_ce.linear_cross_entropy`: ``weight`` (and ``bias``) a DTensor
    ``Shard(0)`` with ``hidden`` a DTensor ``Replicate()`` or sequence-parallel (tensor
    parallelism: O(N) statistics in forward, the hidden gradient's reduction in backward, outputs
    ``Replicate()``); or sharded parameters with plain ``hidden`` (FSDP2: the weight is gathered
    for the call, its gradient is the sum over processes, reduce-scattered to the shards).
    """
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    check_linear_inputs(hidden, weight, bias)
    if is_dtensor(hidden):
        rows = _vocab_parallel("linear", hidden, weight, bias, labels, options, "token_logprobs")
        return _split(rows, options)
    weight, bias = gathered_head(weight, bias)
    n_classes, width = weight.shape
    spec, tokens = make_spec("linear", options, labels, loss="token_logprobs", batch_shape=hidden.shape[:-1],
                             n_classes=n_classes, device=hidden.device)
    rows = operators.loss_rows(hidden.reshape(-1, width), weight, bias, tokens, spec)
    return _split(rows, options)


def _check_pair(student: torch.Tensor, teacher: torch.Tensor, what: str) -> None:
    if is_dtensor(student) != is_dtensor(teacher):
        raise ValueError(f"student and teacher {what} must share one layout: one is a DTensor and the other is not")
    if teacher.device != student.device:
        raise ValueError(f"student {what} are on {student.device} but the teacher's are on {teacher.device}")


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *,
                      labels: Optional[torch.Tensor] = None, **options: Any) -> torch.Tensor:
    """TRL GKD's generalized Jensen-Shannon divergence between a student and a teacher, in fp32.

    With ``p_s = softmax(z_s / T)``, ``p_t = softmax(z_t / T)`` (``T = temperature``, no ``T**2``
    factor, as in TRL), where each model's ``z`` is its logits times its logit scale, then
    soft-capped with its own soft-cap (TRL's ``DistillationTrainer`` order): ``beta=0`` is
    ``KL(p_t || p_s)``, ``beta=1`` is ``KL(p_s || p_t)``, otherwise
    ``beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)`` with ``m = beta * p_t + (1 - beta) * p_s``;
    per token, summed over the vocabulary (``0 * log 0 =
    0``). No ``[N, V]`` buffer is built beyond the logits' gradients. Gradients reach the student's
    logits, and the teacher's when they require grad.

    Args:
        student_logits, teacher_logits: ``[..., V]`` of one shape, float32 / bfloat16 / float16.
        labels: ``[...]`` integer ids or None: a token counts where ``labels != ignore_index``
            and ``mask`` is nonzero (each when given); every token counts when neither is given.
        beta: in [0, 1] (default 0.5). temperature: finite, > 0 (default 1.0), for both models.
        softcap, logit_scale: the student's soft-cap (None or a finite number > 0, default None:
            Gemma 2/3's ``final_logit_softcapping``) and logit multiplier (finite, default 1.0),
            applied as in :func:`token_logprobs`; gradients chain through them.
        teacher_softcap, teacher_logit_scale: the same for the teacher, set on their own (defaults
            None and 1.0); the student's values never apply to the teacher, so a soft-capped
            teacher needs ``teacher_softcap`` even when the student has the same one.
        ignore_index, mask, num_label_tokens, chunk_size, compile_chunks: as in
            :func:`functional_ce.cross_entropy`.
        reduction: ``"mean"`` over counted tokens (0 when none), ``"sum"``, or ``"none"`` (fp32
            ``[...]``, 0 where not counted).

    Returns:
        fp32 scalar, or ``[...]`` with ``reduction="none"``.

    Tensor parallel: both logits may be DTensors ``Shard(-1)`` over the vocabulary, placed alike
    (anything else is a ``ValueError``): forward all-reduces 24 bytes per token (20 for beta 0 or
    1), backward nothing; the result is a DTensor ``Replicate()``.
    """
    student_logits = _check_logits("student_logits", student_logits)
    teacher_logits = _check_logits("teacher_logits", teacher_logits)
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} and teacher_logits {tuple(teacher_logits.shape)} "
            "must have one shape (the same tokens and vocabulary)"
        )
    _check_pair(student_logits, teacher_logits, "logits")
    if is_dtensor(student_logits):
        return _vocab_parallel("logits", student_logits, None, None, labels, options, "distillation",
                               second=(teacher_logits, None, None), teacher_grad=teacher_logits.requires_grad)
    n_classes = student_logits.shape[-1]
    spec, tokens = make_spec("logits", options, labels, loss="distillation", batch_shape=student_logits.shape[:-1],
                             n_classes=n_classes, device=student_logits.device,
                             teacher_grad=teacher_logits.requires_grad)
    flat = [t.reshape(-1, n_classes) for t in (student_logits, teacher_logits)]
    return operators.loss_rows(flat[0], None, None, tokens, spec, second=(flat[1], None, None))


def linear_distillation_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                             teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, *,
                             student_bias: Optional[torch.Tensor] = None, teacher_bias: Optional[torch.Tensor] = None,
                             labels: Optional[torch.Tensor] = None, **options: Any) -> torch.Tensor:
    """:func:`distillation_loss` of ``student_hidden @ student_weight.T + student_bias`` and the
    teacher's logits, without ever building either.

    The teacher's hidden size may differ from the student's; the vocabulary is the same. With a
    scalar reduction and gradients required, forward computes the gradients for a unit upstream
    gradient (each chunk's two logits built once) and backward scales them, unless
    ``recompute_logits_in_backward=True``; ``"none"`` always recomputes in backward.

    Args:
        student_hidden: ``[..., H]``; student_weight ``[V, H]``; teacher_hidden ``[..., Ht]`` (same
            token shape); teacher_weight ``[V, Ht]``; biases ``[V]`` or None; float32 / bfloat16 /
            float16, each head of one dtype, all on one device.
        labels: as in :func:`distillation_loss`.
        **options: ``beta``, ``temperature``, ``softcap``, ``logit_scale``, ``teacher_softcap``,
            ``teacher_logit_scale``, ``ignore_index``, ``mask``, ``reduction``, ``num_label_tokens``,
            ``chunk_size``, ``compile_chunks``: as in :func:`distillation_loss` (the scales multiply
            each model's logits, not its hidden states).
        recompute_logits_in_backward: as in :func:`functional_ce.linear_cross_entropy`.

    Returns:
        fp32 scalar, or ``[...]`` with ``reduction="none"``.

    Layouts as in :func:`linear_token_logprobs`; under tensor parallelism the teacher's hidden
    states and head are placed exactly as the student's (a ``ValueError`` otherwise), and the
    combined statistics are computed once for both.
    """
    heads = []
    for who, h, w, b in (("student", student_hidden, student_weight, student_bias),
                         ("teacher", teacher_hidden, teacher_weight, teacher_bias)):
        h, w, b = autocast_inputs(h, w, b)
        try:
            check_linear_inputs(h, w, b)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{who}: {exc}") from None
        heads.append((h, w, b))
    (hs, ws, bs), (ht, wt, bt) = heads
    if hs.shape[:-1] != ht.shape[:-1]:
        raise ValueError(f"student_hidden {tuple(hs.shape)} and teacher_hidden {tuple(ht.shape)} must have one "
                         "token shape [...]")
    if ws.shape[0] != wt.shape[0]:
        raise ValueError(f"student_weight has {ws.shape[0]} classes and teacher_weight {wt.shape[0]}: the "
                         "vocabularies must be the same")
    _check_pair(hs, ht, "hidden states")
    teacher_grad = any(t is not None and t.requires_grad for t in (ht, wt, bt))
    if is_dtensor(hs):
        return _vocab_parallel("linear", hs, ws, bs, labels, options, "distillation", second=(ht, wt, bt),
                               teacher_grad=teacher_grad)
    (ws, bs), (wt, bt) = gathered_head(ws, bs), gathered_head(wt, bt)
    n = math.prod(hs.shape[:-1])
    spec, tokens = make_spec("linear", options, labels, loss="distillation", batch_shape=hs.shape[:-1],
                             n_classes=ws.shape[0], device=hs.device, teacher_grad=teacher_grad)
    second = (ht.reshape(n, ht.shape[-1]), wt, bt)
    return operators.loss_rows(hs.reshape(n, hs.shape[-1]), ws, bs, tokens, spec, second=second)


keyword_signature(token_logprobs, "logits", loss="token_logprobs")
keyword_signature(linear_token_logprobs, "linear", loss="token_logprobs")
keyword_signature(distillation_loss, "logits", loss="distillation")
keyword_signature(linear_distillation_loss, "linear", loss="distillation")

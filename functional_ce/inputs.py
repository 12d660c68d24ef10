"""The per-token inputs of a loss call, checked, and the call's :class:`~functional_ce.spec.LossSpec`.

:func:`make_spec` is where every public loss (each form, each layout) turns its keywords and its
labels, mask, weights and token count into a spec and :class:`Tokens`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import numbers
from typing import Any, Callable, Optional, Union

import torch
from torch._subclasses.fake_tensor import is_fake

from .spec import Count, LossSpec, linear_auto_chunk, requested_chunk_rows, spec_part, with_defaults

# --- tensors -----------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

def check_float(name: str, t: object) -> torch.Tensor:
    """``t`` when it is a float32, bfloat16 or float16 tensor, else a ``TypeError`` naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    return t


def check_linear_inputs(hidden: object, weight: object, bias: object) -> None:
    """Check the hidden-state form's inputs: ``hidden [..., H]``, ``weight [V, H]`` and ``bias [V]``
    (or None), floating point, one dtype and one device."""
    hidden = check_float("hidden", hidden)
    weight = check_float("weight", weight)
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dim [..., H], got a 0-dim tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H] (an lm_head weight), got shape {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, got weight shape "
            f"{tuple(weight.shape)}; pass the [vocab, hidden] weight (not its transpose)"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (V >= 1), got V=0")
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"hidden and weight must have one dtype, got hidden {hidden.dtype} and weight {weight.dtype}; "
            "cast one of them (e.g. hidden.to(weight.dtype))"
        )
    if weight.device != hidden.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}; move both to one device")
    if bias is None:
        return
    bias = check_float("bias", bias)
    if bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must have shape ({weight.shape[0]},) (one value per class), got {tuple(bias.shape)}")
    if bias.dtype != weight.dtype:
        raise TypeError(f"bias must have the weight's dtype {weight.dtype}, got {bias.dtype}")
    if bias.device != weight.device:
        raise ValueError(f"bias is on {bias.device} but weight is on {weight.device}")


def autocast_inputs(hidden: object, weight: object, bias: object) -> tuple:
    """Under ``torch.autocast``, cast like ``F.linear`` would: hidden, weight and bias to the
    autocast dtype. Forward and the backward recomputation then see the same low-precision
    operands, and autograd casts the gradients back to the parameters' dtype."""
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return hidden, weight, bias
    device_type = hidden.device.type
    if device_type not in ("cpu", "cuda", "xpu") or not torch.is_autocast_enabled(device_type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        return hidden, weight, bias
    cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return cast(hidden), cast(weight), cast(bias)




def _check_labels(labels: object, batch_shape: torch.Size, device: torch.device, what: str) -> torch.Tensor:
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor (int64 or int32), got {labels.dtype}")
    if labels.shape != batch_shape:
        raise ValueError(
            f"labels must have shape {tuple(batch_shape)} ({what} without its last dim), got {tuple(labels.shape)}"
        )
    if labels.device != device:
        raise ValueError(f"labels are on {labels.device} but {what} is on {device}; move both to one device")
    return labels


def _check_token_tensor(name: str, t: Optional[torch.Tensor], batch_shape: torch.Size, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.shape != batch_shape:
        raise ValueError(f"{name} must have shape {tuple(batch_shape)} (one value per label), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the logits are on {device}")
    if name == "weights" and not t.dtype.is_floating_point:
        raise TypeError(f"weights must be a floating-point tensor, got {t.dtype}")


def _check_count(reduction: str, num_label_tokens: object) -> None:
    """A finite count >= 0 with a scalar reduction: a number, or a one-element tensor whose value
    is checked in eager mode only (a device read-back; not under torch.compile)."""
    if num_label_tokens is None:
        return
    if reduction == "none":
        raise ValueError(
            'num_label_tokens divides a summed loss and needs reduction="mean" or "sum", got reduction="none"'
        )
    if isinstance(num_label_tokens, torch.Tensor):
        if num_label_tokens.numel() != 1:
            raise ValueError(
                f"num_label_tokens must be a scalar, got a tensor of shape {tuple(num_label_tokens.shape)}"
            )
        if num_label_tokens.dtype == torch.bool or num_label_tokens.is_complex():
            raise TypeError(f"num_label_tokens must be a real number tensor, got {num_label_tokens.dtype}")
        if torch.compiler.is_compiling() or is_fake(num_label_tokens):  # no value to read
            return
        value = float(num_label_tokens.detach().reshape(()).item())
    elif isinstance(num_label_tokens, bool) or not isinstance(num_label_tokens, numbers.Real):
        raise TypeError(f"num_label_tokens must be a number or a scalar tensor, got {num_label_tokens!r}")
    else:
        value = float(num_label_tokens)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"num_label_tokens must be a finite count >= 0, got {value!r}")


def _check_label_range(labels: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Eager-only check that every label is a class id or ``ignore_index`` (syncs on GPU; skipped
    on fake tensors, which hold no values)."""
    if labels.numel() == 0 or torch.compiler.is_compiling() or is_fake(labels):
        return
    bad = ((labels < 0) | (labels >= n_classes)) & (labels != ignore_index)
    if bool(bad.any()):
        first = labels[bad][0].item()
        raise ValueError(
            f"labels must be in [0, {n_classes}) or equal ignore_index={ignore_index}; got {int(bad.sum())} "
            f"label(s) outside, e.g. {first}"
        )


# --- the spec of a call ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tokens:
    """The per-token inputs of a call, checked.

    Attributes:
        labels: ``[N]`` int64, ``ignore_index`` wherever the label was ignored or masked.
        batch_shape: the caller's token shape ``[...]`` (``N`` is its product).
        weights: ``[...]`` per-token multipliers or None.
        num_label_tokens: the denominator of a scalar reduction, or None.
    """

    labels: torch.Tensor
    batch_shape: torch.Size
    weights: Optional[torch.Tensor]
    num_label_tokens: Count


def make_spec(
    form: str,
    options: dict[str, Any],
    labels: object,
    *,
    batch_shape: torch.Size,
    n_classes: int,
    device: torch.device,
    loss: str = "cross_entropy",
    row_classes: Optional[int] = None,
    vocab_start: int = 0,
    teacher_grad: bool = False,
) -> tuple[LossSpec, Tokens]:
    """Check a call's keyword ``options`` and per-token inputs; return its spec and tokens.

    ``form`` is ``"logits"`` or ``"linear"`` (it names the float input in messages); ``loss`` a
    key of :data:`functional_ce.maths.LOSSES`; ``n_classes`` the full vocabulary size;
    ``row_classes`` the columns one chunk row holds (this process's slice under vocabulary
    parallelism, default ``n_classes``); ``vocab_start`` where that slice starts. ``labels`` may
    be None for a loss that needs none (distillation): every token then counts, unless masked.
    """
    opts = with_defaults(form, options, loss=loss)
    if opts.get("inplace_grad") is True and torch.compiler.is_compiling():
        # Functionalization would clone the logits and still destroy them: keep them instead
        # (documented; dynamo cannot trace a logging call here without a graph break).
        opts["inplace_grad"] = False
    auto_rows, auto_bytes = linear_auto_chunk(device) if form == "linear" else (None, None)
    # a distillation chunk holds two [c, V] blocks of fp32 logits
    row_bytes = (n_classes if row_classes is None else row_classes) * 4 * (2 if loss == "distillation" else 1)
    fixed = {"reduction": "none"} if loss == "token_logprobs" else {}
    spec = LossSpec(
        **spec_part(opts), **fixed, loss=loss, form=form, vocab_start=vocab_start, n_classes=n_classes,
        chunk_rows=requested_chunk_rows(opts["chunk_size"], row_bytes, auto_bytes, auto_rows),
        teacher_grad=teacher_grad,
    )
    mask, weights, count = (opts.get(k) for k in ("mask", "weights", "num_label_tokens"))
    _check_token_tensor("mask", mask, batch_shape, device)
    _check_token_tensor("weights", weights, batch_shape, device)
    _check_count(spec.reduction, count)
    if labels is None:  # every token counts: any label value but ignore_index
        labels1d = torch.full((math.prod(batch_shape),), int(spec.ignore_index == 0), dtype=torch.long, device=device)
    else:
        labels = _check_labels(labels, batch_shape, device, form)
        _check_label_range(labels, n_classes, spec.ignore_index)
        labels1d = labels.reshape(-1).long()
    if mask is not None:
        labels1d = torch.where(mask.reshape(-1).bool(), labels1d, spec.ignore_index)
    return spec, Tokens(labels1d, batch_shape, weights, count)


# --- which rows carry a loss, and how the rows reduce -----------------------------------------


#: Set while an operator's loop runs on fake tensors (:mod:`functional_ce.workspace`): makes the
#: valid rows, found from the real labels beforehand (fake labels have no values to read).
KNOWN_ROWS: contextvars.ContextVar[Optional[Callable[[], "ValidRows"]]] = contextvars.ContextVar(
    "functional_ce_known_rows", default=None)


@dataclasses.dataclass(frozen=True)
class ValidRows:
    """The rows that carry a loss (label != ignore_index), so ignored rows cost no matmul.

    ``index`` is None when every row is valid (nothing is gathered then).
    """

    n: int
    index: Optional[torch.Tensor]

    @staticmethod
    def of(labels: torch.Tensor, ignore_index: int) -> "ValidRows":
        known = KNOWN_ROWS.get()
        if known is not None:  # the operator runs on fake tensors to report its workspace
            return known()
        valid = labels != ignore_index
        if bool(valid.all()):  # one host read-back per call (a sync on GPU)
            return ValidRows(labels.shape[0], None)
        return ValidRows(labels.shape[0], valid.nonzero().squeeze(1))

    def take(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The valid rows of ``t`` ``[N, ...]``."""
        return t if self.index is None or t is None else t.index_select(0, self.index)

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """``[n_valid, ...]`` back to ``[N, ...]``, zeros on the ignored rows."""
        if self.index is None:
            return t
        full = t.new_zeros((self.n, *t.shape[1:]))
        return full.index_copy_(0, self.index, t)


def _denominator(tokens: Tokens, spec: LossSpec) -> Union[float, torch.Tensor, None]:
    """What the weighted sum is divided by: None for a plain sum."""
    if tokens.num_label_tokens is not None:
        return tokens.num_label_tokens
    if spec.reduction == "mean":
        return (tokens.labels != spec.ignore_index).sum()
    return None


def _divide(x: torch.Tensor, count: Union[float, torch.Tensor, None]) -> torch.Tensor:
    """``x / count``, 0 where the count is 0."""
    if count is None:
        return x
    if isinstance(count, torch.Tensor):
        n = count.reshape(()).to(device=x.device, dtype=torch.float32)
        return torch.where(n > 0, x / torch.where(n > 0, n, 1.0), 0.0)
    return x / float(count) if count > 0 else x * 0.0


def row_coefficients(tokens: Tokens, spec: LossSpec) -> torch.Tensor:
    """``[N]`` fp32: each row's factor in the scalar loss (weight over denominator, 0 if ignored),
    so that the reduction equals ``sum(coef * loss_rows)``."""
    valid = (tokens.labels != spec.ignore_index).float()
    if tokens.weights is not None:
        valid = valid * tokens.weights.reshape(-1).float()
    return _divide(valid, _denominator(tokens, spec))


def reduce_rows(loss_rows: torch.Tensor, tokens: Tokens, spec: LossSpec) -> torch.Tensor:
    """Weights, then the reduction, of fp32 per-row losses ``[N]`` (0 on ignored rows): ``"mean"``
    divides the weighted sum by ``num_label_tokens`` when given, else by the number of valid
    tokens; ``"sum"`` by ``num_label_tokens`` when given. A count of 0 gives 0."""
    if tokens.weights is not None:
        loss_rows = loss_rows * tokens.weights.reshape(-1).float()
    if spec.reduction == "none":
        return loss_rows.reshape((*tokens.batch_shape, *loss_rows.shape[1:]))
    return _divide(loss_rows.sum(), _denominator(tokens, spec))

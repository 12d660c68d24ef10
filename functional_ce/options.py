"""Loss options and the input checks shared by every public loss entry point."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal, Optional, Union

import torch

ChunkSize = Union[int, Literal["auto"], None]
Reduction = Literal["mean", "sum", "none"]

#: Bytes that one fp32 chunk of logits may take when ``chunk_size="auto"``.
AUTO_CHUNK_BYTES = 256 * 1024 * 1024

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_REDUCTIONS = ("mean", "sum", "none")


@dataclasses.dataclass(frozen=True)
class ChunkOptions:
    """What the per-chunk maths depends on, besides tensors.

    Frozen and hashable so that a compiled chunk graph specialises on it and on nothing else.
    The fields, in order, are also the custom operators' option arguments: :meth:`op_args`
    gives them, and ``ChunkOptions(*args)`` turns them back into options.

    Attributes:
        ignore_index: label value whose rows contribute no loss and get zero gradient.
        label_smoothing: epsilon of ``torch.nn.functional.cross_entropy``'s definition, in [0, 1].
        z_loss: coefficient of ``logsumexp(logits) ** 2`` added to each valid row's loss.
        softcap: if set, logits are replaced by ``softcap * tanh(logits / softcap)`` first.
        vocab_start: the class id of a chunk's first column: 0, or where this process's slice
            of a vocabulary-parallel (sharded) vocabulary starts.
        n_classes: the full vocabulary size V when a chunk holds only a slice of it (label
            smoothing spreads ``eps / V`` over all V classes); None when a chunk holds them all.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: Optional[float] = None
    vocab_start: int = 0
    n_classes: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, numbers.Integral):
            raise TypeError(f"ignore_index must be an int, got {self.ignore_index!r}")
        ls = _real("label_smoothing", self.label_smoothing)
        if not 0.0 <= ls <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing!r}")
        z = _real("z_loss", self.z_loss)
        if not 0.0 <= z < math.inf:
            raise ValueError(f"z_loss must be a finite number >= 0, got {self.z_loss!r}")
        if self.softcap is not None:
            cap = _real("softcap", self.softcap)
            if not 0.0 < cap < math.inf:
                raise ValueError(f"softcap must be None or a finite number > 0, got {self.softcap!r}")
            object.__setattr__(self, "softcap", cap)
        start = self.vocab_start
        if isinstance(start, bool) or not isinstance(start, numbers.Integral) or start < 0:
            raise ValueError(f"vocab_start must be an int >= 0, got {self.vocab_start!r}")
        if self.n_classes is not None and (
            isinstance(self.n_classes, bool) or not isinstance(self.n_classes, numbers.Integral) or self.n_classes < 1
        ):
            raise ValueError(f"n_classes must be None or an int >= 1, got {self.n_classes!r}")
        object.__setattr__(self, "vocab_start", int(self.vocab_start))
        if self.n_classes is not None:
            object.__setattr__(self, "n_classes", int(self.n_classes))
        object.__setattr__(self, "ignore_index", int(self.ignore_index))
        object.__setattr__(self, "label_smoothing", ls)
        object.__setattr__(self, "z_loss", z)

    def op_args(self) -> tuple[int, float, float, Optional[float], int, Optional[int]]:
        """``(ignore_index, label_smoothing, z_loss, softcap, vocab_start, n_classes)``, as the
        custom operators take them."""
        return dataclasses.astuple(self)


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def check_chunk_size(chunk_size: object) -> None:
    """``chunk_size`` must be a positive int, ``"auto"`` or None."""
    if chunk_size == "auto" or chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f'chunk_size must be a positive int, "auto" or None, got {chunk_size!r}')
    if chunk_size <= 0:
        raise ValueError(f'chunk_size must be a positive int, "auto" or None, got {chunk_size}')


def resolve_chunk_size(
    chunk_size: ChunkSize, n_rows: int, row_bytes: int, auto_bytes: Optional[int] = None,
    auto_rows: Optional[int] = None,
) -> int:
    """Rows per chunk for ``n_rows`` rows whose fp32 form takes ``row_bytes`` bytes each.

    ``"auto"`` takes ``auto_rows`` rows (no limit when None), fewer where one fp32 chunk would
    pass ``auto_bytes`` (default ``AUTO_CHUNK_BYTES``); ``None`` is one chunk.
    """
    check_chunk_size(chunk_size)
    if chunk_size == "auto":
        budget = AUTO_CHUNK_BYTES if auto_bytes is None else auto_bytes
        rows = max(1, budget // max(1, row_bytes))
        if auto_rows is not None:
            rows = min(rows, auto_rows)
        if rows >= 64:
            rows -= rows % 32  # aligned chunks vectorise better
    elif chunk_size is None:
        rows = n_rows
    else:
        rows = int(chunk_size)
    return max(1, min(rows, n_rows))


def check_reduction(reduction: object, num_label_tokens: object) -> None:
    """``reduction`` is one of ``"mean"``, ``"sum"``, ``"none"``; ``num_label_tokens`` a count.

    ``num_label_tokens`` needs a scalar reduction and must be a finite number >= 0: a Python
    number, or a one-element tensor whose value is checked in eager mode only (that reads it
    back from the device; under torch.compile it is not checked).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
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
        if torch.compiler.is_compiling():
            return
        value = float(num_label_tokens.detach().reshape(()).item())
    elif isinstance(num_label_tokens, bool) or not isinstance(num_label_tokens, numbers.Real):
        raise TypeError(f"num_label_tokens must be a number or a scalar tensor, got {num_label_tokens!r}")
    else:
        value = float(num_label_tokens)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"num_label_tokens must be a finite count >= 0, got {value!r}")


def is_dtensor(t: object) -> bool:
    """``t`` is a ``torch.distributed.tensor.DTensor`` (False where torch has no distributed support)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def check_float(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    return t


def check_labels(labels: object, batch_shape: torch.Size, device: torch.device, what: str) -> torch.Tensor:
    """Labels must be an integer tensor of ``batch_shape`` on ``device``."""
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


def check_token_tensor(name: str, t: Optional[torch.Tensor], batch_shape: torch.Size, device: torch.device) -> None:
    """``mask`` / ``weights``: one value per token, on the logits' device."""
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


def check_label_range(labels: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Eager-only check that every label is a class id or ``ignore_index`` (syncs on GPU)."""
    if labels.numel() == 0 or torch.compiler.is_compiling():
        return
    bad = ((labels < 0) | (labels >= n_classes)) & (labels != ignore_index)
    if bool(bad.any()):
        first = labels[bad][0].item()
        raise ValueError(
            f"labels must be in [0, {n_classes}) or equal ignore_index={ignore_index}; got {int(bad.sum())} "
            f"label(s) outside, e.g. {first}"
        )

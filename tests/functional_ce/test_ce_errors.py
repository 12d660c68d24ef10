"""Bad input raises ValueError/TypeError that names what was received and what was expected."""

from __future__ import annotations

import pytest
import torch

import functional_ce

X = torch.randn(4, 6, 10)
Y = torch.randint(0, 10, (4, 6))


@pytest.mark.parametrize(
    "logits, labels, kwargs, exc, pattern",
    [
        (X.double(), Y, {}, TypeError, "float32, bfloat16 or float16, got torch.float64"),
        (X.tolist(), Y, {}, TypeError, "must be a torch.Tensor, got list"),
        (torch.tensor(1.0), torch.tensor(1), {}, ValueError, "at least one dim"),
        (X, Y[:, :5], {}, ValueError, r"labels must have shape \(4, 6\).*got \(4, 5\)"),
        (X, Y.float(), {}, TypeError, "integer tensor.*got torch.float32"),
        (X, Y.bool(), {}, TypeError, "integer tensor.*got torch.bool"),
        (X, Y, {"chunk_size": 0}, ValueError, 'chunk_size must be a positive int, "auto" or None, got 0'),
        (X, Y, {"chunk_size": -3}, ValueError, "got -3"),
        (X, Y, {"chunk_size": 2.5}, TypeError, "got 2.5"),
        (X, Y, {"chunk_size": "big"}, TypeError, "got 'big'"),
        (X, Y, {"chunk_size": True}, TypeError, "got True"),
        (X, Y, {"reduction": "avg"}, ValueError, r"reduction must be one of \('mean', 'sum', 'none'\), got 'avg'"),
        (X, Y, {"reduction": "none", "num_label_tokens": 5}, ValueError, 'needs reduction="mean" or "sum"'),
        (X, Y, {"num_label_tokens": -1}, ValueError, "num_label_tokens must be a finite count >= 0, got -1.0"),
        (X, Y, {"num_label_tokens": float("nan")}, ValueError, "num_label_tokens must be a finite count >= 0, got nan"),
        (X, Y, {"num_label_tokens": float("inf")}, ValueError, "finite count >= 0, got inf"),
        (X, Y, {"num_label_tokens": -float("inf"), "reduction": "sum"}, ValueError, "got -inf"),
        (X, Y, {"num_label_tokens": torch.tensor(float("nan"))}, ValueError, "finite count >= 0, got nan"),
        (X, Y, {"num_label_tokens": torch.tensor(float("inf"))}, ValueError, "finite count >= 0, got inf"),
        (X, Y, {"num_label_tokens": torch.tensor(-2)}, ValueError, "finite count >= 0, got -2.0"),
        (X, Y, {"num_label_tokens": True}, TypeError, "num_label_tokens must be a number or a scalar tensor"),
        (X, Y, {"num_label_tokens": "7"}, TypeError, "num_label_tokens must be a number or a scalar tensor"),
        (X, Y, {"num_label_tokens": torch.tensor(True)}, TypeError, "real number tensor, got torch.bool"),
        (X, Y, {"num_label_tokens": torch.ones(2)}, ValueError, r"scalar.*shape \(2,\)"),
        (X, Y, {"z_loss": float("inf")}, ValueError, "z_loss must be a finite number >= 0"),
        (X, Y, {"z_loss": float("nan")}, ValueError, "z_loss must be a finite number >= 0"),
        (X, Y, {"softcap": float("inf")}, ValueError, "softcap must be None or a finite number > 0"),
        (X, Y, {"label_smoothing": float("nan")}, ValueError, r"label_smoothing must be in \[0, 1\], got nan"),
        (X, Y, {"compile_chunks": 1}, TypeError, "compile_chunks must be True, False or None, got 1"),
        (X, Y, {"mask": [1, 0]}, TypeError, "mask must be a torch.Tensor or None, got list"),
        (X, Y, {"label_smoothing": 1.5}, ValueError, r"label_smoothing must be in \[0, 1\], got 1.5"),
        (X, Y, {"label_smoothing": -0.1}, ValueError, "got -0.1"),
        (X, Y, {"z_loss": -1.0}, ValueError, "z_loss must be a finite number >= 0"),
        (X, Y, {"softcap": 0.0}, ValueError, "softcap must be None or a finite number > 0"),
        (X, Y, {"mask": torch.ones(4, 5)}, ValueError, r"mask must have shape \(4, 6\)"),
        (X, Y, {"weights": torch.ones(24)}, ValueError, r"weights must have shape \(4, 6\)"),
        (X, Y, {"weights": torch.ones(4, 6, dtype=torch.long)}, TypeError, "weights must be a floating-point"),
        (X, Y, {"ignore_index": 1.0}, TypeError, "ignore_index must be an int"),
        (X, Y, {"inplace_grad": 1}, TypeError, "inplace_grad must be a bool"),
        (X, torch.full((4, 6), 10), {}, ValueError, r"labels must be in \[0, 10\) or equal ignore_index=-100.*e.g. 10"),
        (X, torch.full((4, 6), -5), {}, ValueError, "e.g. -5"),
        (X[..., :0], Y, {}, ValueError, "at least one class"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(logits, labels, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        functional_ce.cross_entropy(logits, labels, **kwargs)


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        ({"reduction": "avg"}, ValueError, "reduction must be one of"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be a positive int"),
        ({"label_smoothing": 2.0}, ValueError, "label_smoothing must be in"),
        ({"softcap": -1.0}, ValueError, "softcap must be None or a finite number > 0"),
        ({"inplace_grad": "yes"}, TypeError, "inplace_grad must be a bool"),
        ({"compile_chunks": "no"}, TypeError, "compile_chunks must be True, False or None"),
        ({"ignore_index": None}, TypeError, "ignore_index must be an int"),
    ],
)
def test_module_form_checks_its_options_when_built(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        functional_ce.CrossEntropyLoss(**kwargs)


def test_device_mismatch_is_refused():
    meta_labels = Y.to("meta")
    with pytest.raises(ValueError, match="labels are on meta but logits is on cpu"):
        functional_ce.cross_entropy(X, meta_labels)
    with pytest.raises(ValueError, match="mask is on meta"):
        functional_ce.cross_entropy(X, Y, mask=torch.ones(4, 6, device="meta"))

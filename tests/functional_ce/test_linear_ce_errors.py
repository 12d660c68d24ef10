"""Bad input to linear_cross_entropy raises TypeError/ValueError saying what was wrong."""

from __future__ import annotations

import pytest
import torch

import functional_ce

H, V, N = 8, 11, 5


def _ok():
    return dict(
        hidden=torch.randn(N, H), weight=torch.randn(V, H), labels=torch.randint(0, V, (N,)), bias=None
    )


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(hidden=torch.randn(N, H + 1)), ValueError, r"H = hidden.shape\[-1\] = 9"),
        (dict(weight=torch.randn(H, V)), ValueError, "not its transpose"),
        (dict(weight=torch.randn(V, H, 1)), ValueError, r"weight must be 2-D \[V, H\]"),
        (dict(weight=torch.randn(0, H)), ValueError, "V >= 1"),
        (dict(hidden=torch.randn(N, H, dtype=torch.bfloat16)), TypeError, "one dtype"),
        (dict(hidden=torch.randint(0, 3, (N, H))), TypeError, "hidden must be float32, bfloat16 or float16"),
        (dict(hidden=torch.randn(N, H, dtype=torch.float64), weight=torch.randn(V, H, dtype=torch.float64)),
         TypeError, "float32, bfloat16 or float16"),
        (dict(hidden=[[0.0] * H]), TypeError, "must be a torch.Tensor"),
        (dict(bias=torch.randn(V + 1)), ValueError, r"bias must have shape \(11,\)"),
        (dict(bias=torch.randn(V, dtype=torch.bfloat16)), TypeError, "bias must have the weight's dtype"),
        (dict(labels=torch.randint(0, V, (N + 1,))), ValueError, r"labels must have shape \(5,\)"),
        (dict(labels=torch.rand(N)), TypeError, "labels must be an integer tensor"),
        (dict(labels=torch.tensor([0, 1, V, 2, 3])), ValueError, r"labels must be in \[0, 11\)"),
        (dict(labels=torch.tensor([0, 1, -5, 2, 3])), ValueError, "e.g. -5"),
    ],
)
def test_bad_input_is_explained(change, error, match):
    kw = dict(_ok(), **change)
    with pytest.raises(error, match=match):
        functional_ce.linear_cross_entropy(kw["hidden"], kw["weight"], kw["labels"], bias=kw["bias"])


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
        (dict(reduction="avg"), ValueError, "reduction must be one of"),
        (dict(reduction="none", num_label_tokens=3), ValueError, 'needs reduction="mean" or "sum"'),
        (dict(num_label_tokens=float("nan")), ValueError, "num_label_tokens must be a finite count >= 0, got nan"),
        (dict(num_label_tokens=torch.tensor(float("inf"))), ValueError, "finite count >= 0, got inf"),
        (dict(compile_chunks=0), TypeError, "compile_chunks must be True, False or None"),
        (dict(label_smoothing=1.5), ValueError, r"label_smoothing must be in \[0, 1\]"),
        (dict(softcap=0.0), ValueError, "softcap must be None or a finite number > 0"),
        (dict(mask=torch.ones(N + 1, dtype=torch.bool)), ValueError, "mask must have shape"),
        (dict(weights=torch.ones(N, dtype=torch.long)), TypeError, "weights must be a floating-point"),
    ],
)
def test_bad_options_are_explained(options, error, match):
    kw = _ok()
    with pytest.raises(error, match=match):
        functional_ce.linear_cross_entropy(kw["hidden"], kw["weight"], kw["labels"], **options)


def test_meta_device_mismatch_is_explained():
    kw = _ok()
    with pytest.raises(ValueError, match="move both to one device"):
        functional_ce.linear_cross_entropy(kw["hidden"], kw["weight"].to("meta"), kw["labels"])

"""The loss spec: every keyword declared once, checked once, and carried to the operators whole."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functional_ce
from functional_ce import compiled_chunks as compiled
from functional_ce.spec import LossSpec, decode
from tests.functional_ce.ce_cases import COMPILED_V, loss_and_grad, make_case

SPECS = st.builds(
    LossSpec,
    ignore_index=st.integers(-(2**40), 2**40),
    label_smoothing=st.floats(0.0, 1.0),
    z_loss=st.floats(0.0, 1e3),
    softcap=st.none() | st.floats(1e-3, 1e4),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    compile_chunks=st.sampled_from([None, True, False]),
    inplace_grad=st.booleans(),
    recompute_logits_in_backward=st.booleans(),
    form=st.sampled_from(["logits", "linear"]),
    chunk_rows=st.integers(0, 2**20),
    vocab_start=st.integers(0, 2**31),
    n_classes=st.none() | st.integers(1, 2**31),
    teacher_softcap=st.none() | st.floats(1e-3, 1e4),
    teacher_logit_scale=st.floats(-1e3, 1e3),
)


@given(SPECS)
def test_the_encoded_spec_the_operators_receive_decodes_to_the_same_spec(spec):
    encoded = spec.encode()
    assert isinstance(encoded, str)
    assert decode(encoded) == spec
    assert hash(decode(encoded)) == hash(spec)


@given(SPECS)
def test_the_maths_projection_keeps_exactly_the_fields_the_chunk_maths_reads(spec):
    maths = spec.maths()
    kept = ("ignore_index", "label_smoothing", "z_loss", "softcap", "loss", "form", "vocab_start", "n_classes",
            "teacher_softcap", "teacher_logit_scale")
    assert all(getattr(maths, f) == getattr(spec, f) for f in kept)
    assert maths == LossSpec(**{f: getattr(spec, f) for f in kept})


@pytest.mark.parametrize("fn, form", [(functional_ce.cross_entropy, "logits"),
                                      (functional_ce.linear_cross_entropy, "linear")])
def test_each_signature_lists_its_keywords_with_their_defaults(fn, form):
    params = inspect.signature(fn).parameters
    common = {"ignore_index": -100, "mask": None, "weights": None, "reduction": "mean", "num_label_tokens": None,
              "label_smoothing": 0.0, "z_loss": 0.0, "softcap": None, "chunk_size": "auto", "compile_chunks": None}
    own = {"logits": {"inplace_grad": False}, "linear": {"recompute_logits_in_backward": False, "bias": None}}[form]
    for name, default in {**common, **own}.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default == default, name
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    other = "recompute_logits_in_backward" if form == "logits" else "inplace_grad"
    assert other not in params


def test_module_signatures_list_the_held_keywords_only():
    params = inspect.signature(functional_ce.CrossEntropyLoss).parameters
    assert "z_loss" in params and "inplace_grad" in params and "mask" not in params
    params = inspect.signature(functional_ce.LinearCrossEntropyLoss).parameters
    assert "recompute_logits_in_backward" in params and "inplace_grad" not in params


def test_unknown_or_misplaced_keywords_are_refused_by_name():
    logits, labels = torch.randn(4, 7), torch.randint(0, 7, (4,))
    with pytest.raises(TypeError, match="z_los"):
        functional_ce.cross_entropy(logits, labels, z_los=1e-4)
    with pytest.raises(TypeError, match="recompute_logits_in_backward"):
        functional_ce.cross_entropy(logits, labels, recompute_logits_in_backward=True)
    with pytest.raises(TypeError, match="inplace_grad"):
        functional_ce.linear_cross_entropy(torch.randn(4, 3), torch.randn(7, 3), labels, inplace_grad=True)
    with pytest.raises(TypeError, match="mask"):
        functional_ce.CrossEntropyLoss(mask=torch.ones(4))  # per batch: given to forward, not held
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        functional_ce.LinearCrossEntropyLoss(label_smoothing=2.0)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        functional_ce.pipeline_loss_fn(torch.nn.Linear(3, 7), ignore_index=1.5)


def test_deprecated_names_warn_and_still_work():
    head = torch.nn.Linear(3, 7)
    with pytest.warns(DeprecationWarning, match="pipeline_loss_fn"):
        loss_fn = functional_ce.hidden_state_loss_fn(head)
    hidden, target = torch.randn(4, 3), torch.randint(0, 7, (4,))
    torch.testing.assert_close(loss_fn(hidden, target), functional_ce.pipeline_loss_fn(head)(hidden, target))
    with pytest.warns(DeprecationWarning, match="LossSpec"):
        assert functional_ce.ChunkOptions is functional_ce.LossSpec
    assert "ChunkOptions" not in functional_ce.__all__ and "hidden_state_loss_fn" not in functional_ce.__all__


def test_a_module_reads_its_options_at_each_call():
    case = make_case(0, (9,), 11, torch.float32)
    loss_fn = functional_ce.CrossEntropyLoss(z_loss=1e-2)
    loss_fn.reduction = "sum"
    assert "reduction='sum'" in repr(loss_fn)
    want = functional_ce.cross_entropy(case.logits, case.labels, z_loss=1e-2, reduction="sum")
    torch.testing.assert_close(loss_fn(case.logits, case.labels), want, rtol=0, atol=0)


def test_reductions_and_chunk_sizes_share_compiled_chunk_graphs(monkeypatch):
    """Chunk graphs specialise on the maths only: a second reduction or chunk size compiles nothing."""
    monkeypatch.setattr(compiled, "_graphs", {})
    case = make_case(5, (40,), COMPILED_V, torch.float32, z_loss=1e-3)
    loss_and_grad(functional_ce.cross_entropy, case, chunk_size=16, compile_chunks=True)
    first = set(compiled.compiled_configurations())
    for kw in ({"reduction": "sum"}, {"chunk_size": 8}, {"reduction": "sum", "chunk_size": 5, "num_label_tokens": 3}):
        loss_and_grad(functional_ce.cross_entropy, case, compile_chunks=True, **{"chunk_size": 16, **kw})
    assert set(compiled.compiled_configurations()) == first and len(first) == 2

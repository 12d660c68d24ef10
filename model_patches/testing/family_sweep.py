"""The packing oracle over every causal-LM family Transformers can build: correct, refused, or a leak.

:func:`sweep_family` builds a tiny random-init model of one ``model_type`` (hidden 64, 2 layers,
no download, :mod:`model_patches.testing.tiny_models`), runs the packed batch of
:mod:`model_patches.testing.packing_oracle` and classifies:

- ``"correct"``: packed logits equal each document alone (max gap <= ``tol``, fp32);
- ``"refused"``: ``enable_packing(model=...)`` (or, with ``use_model=False``, the forward under
  plain ``enable_packing()``) raised an error that names a reason;
- ``"leak"``: neither: packing was accepted and documents saw each other (the failure);
- ``"not built"``: the family cannot be built or run from ``input_ids`` alone at tiny size on
  CPU (multimodal heads needing pixels, encoder-decoders, ...); ``detail`` says why.

Shared by ``tests/model_patches/packing/test_packing_families.py`` and ``python -m bench --only packing``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from typing import Any, Optional

import torch

from .packing_oracle import logits_gap, packed_batch
from .tiny_models import tiny_causal_lm

__all__ = ["SweepResult", "causal_lm_families", "tiny_causal_lm", "sweep_family"]

@dataclasses.dataclass(frozen=True)
class SweepResult:
    """One family's outcome: ``outcome`` in correct / refused / leak / not built."""

    family: str
    outcome: str
    gap: Optional[float] = None
    detail: str = ""
    stock_gap: Optional[float] = None  # the same batch without packing (documents leak there)
    #: capabilities packing makes document-aware in this family (``alibi``, ``stateful_mixer``);
    #: empty for families whose only sequence mixer is masked attention
    made_correct: tuple[str, ...] = ()


def causal_lm_families() -> list[str]:
    """Every ``model_type`` with an ``AutoModelForCausalLM`` entry in the installed Transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@contextlib.contextmanager
def _quiet():
    level = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logging.getLogger("transformers").setLevel(level)


def sweep_family(model_type: str, use_model: bool = True, tol: float = 1e-4,
                 batch: Optional[dict[str, torch.Tensor]] = None, with_stock: bool = False,
                 **overrides: Any) -> SweepResult:
    """Classify ``model_type`` under packing (see module docstring).

    The packed forward runs on the family's default attention backend (sdpa where supported;
    some families, e.g. those with attention sinks, only compute correctly on eager).
    ``with_stock``: also measure the same batch without packing (``stock_gap``).
    """
    from ..packing.coverage import capabilities_for_config
    from ..packing.enable import enable_packing

    batch = batch if batch is not None else packed_batch()
    with _quiet():
        model, failure = None, ""
        for drop in ((), ("head_dim", "num_key_value_heads")):  # second try: the family's own head sizes
            try:
                model = tiny_causal_lm(model_type, None, drop=drop, **overrides)
                with torch.no_grad():
                    model(input_ids=batch["input_ids"][:1, :4])
                break
            except Exception as exc:  # noqa: BLE001 - any failure to build or run means "not built"
                model, failure = None, f"{type(exc).__name__}: {str(exc)[:160]}"
        if model is None:
            return SweepResult(model_type, "not built", detail=failure)
        handle = None
        implementation = model.config._attn_implementation or "eager"
        stock = None
        if with_stock:
            try:
                stock = logits_gap(model, batch, implementation)
            except Exception:  # noqa: BLE001 - a stock forward that rejects the mask has no stock gap
                stock = None
        try:
            handle = enable_packing(model=model) if use_model else enable_packing()
            gap = logits_gap(model, batch, implementation)
        except (ValueError, RuntimeError) as exc:
            message = str(exc)
            if "pack" in message and ("Fix" in message or "refused" in message or "not supported" in message):
                return SweepResult(model_type, "refused", detail=message.split(". ")[0][:200], stock_gap=stock)
            return SweepResult(model_type, "not built", detail=f"{type(exc).__name__}: {message[:160]}")
        except Exception as exc:  # noqa: BLE001 - a forward that cannot run packed at all
            return SweepResult(model_type, "not built", detail=f"{type(exc).__name__}: {str(exc)[:160]}")
        finally:
            if handle is not None:
                handle.remove()
    outcome = "correct" if gap <= tol else "leak"
    made = tuple(c.name for c in capabilities_for_config(model.config) if c.targets_for(model_type))
    return SweepResult(model_type, outcome, gap=gap, detail=implementation, stock_gap=stock, made_correct=made)

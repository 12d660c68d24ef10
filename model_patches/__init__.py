"""Version-gated registries of Hugging Face Transformers patches."""

import importlib
from typing import Any

# public name -> submodule; imported on first use so that `import model_patches` stays light.
_LAZY: dict[str, str] = {}

# packing (sequence packing that keeps documents apart)
_LAZY.update(
    enable_packing="packing",
    packing_status="packing",
    PackingCollator="collator",
    PatchRecord="registry",
    PatchHandle="registry",
    PatchError="registry",
    apply_records="registry",
    record_status="registry",
)

# loss path (causal-LM loss without the fp32 logits copy, or without logits at all)
_LAZY.update(
    enable_chunked_loss="loss_records",
    chunked_loss_status="loss_records",
    causal_lm_loss="hidden_state_loss",
    enable_hidden_state_loss="hidden_state_loss",
    HiddenStateLossHandle="hidden_state_loss",
)

# RL log-probs and distillation from hidden states (no logits)
_LAZY.update(
    causal_lm_token_logprobs="logprob_loss",
    causal_lm_distillation_loss="logprob_loss",
)

__all__: list[str] = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Version-gated registries of Hugging Face Transformers patches.

- :mod:`model_patches.packing`: sequence packing that keeps documents apart.
- :mod:`model_patches.loss`: the causal-LM loss on ``functional_ce``, with or without logits.
- :mod:`model_patches.testing`: test tooling (the flash-attention double, the packing oracle,
  the family sweep, the tiny-model factory).
- :mod:`model_patches.registry` (records, handles, status rows), :mod:`model_patches.arguments`
  and :mod:`model_patches.targets` (reading calls, checking signatures) and
  :mod:`model_patches.targets` serve them all; every handle stands on :mod:`patch_layer`.

The names below are imported on first use, so that ``import model_patches`` stays light; the
``TYPE_CHECKING`` imports show them to IDEs and type checkers.
"""

import importlib
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checkpoint_resume import enable_resume_conversion, resume_conversion_status
    from .context_parallel import ContextParallelHandle, enable_context_parallel
    from .loss.chunked_loss import chunked_loss_status, enable_chunked_loss
    from .loss.linear_cross_entropy import LinearCrossEntropyHandle, causal_lm_loss, enable_linear_cross_entropy
    from .loss.token_losses import causal_lm_distillation_loss, causal_lm_token_logprobs
    from .loss.trl_heads import enable_trl_heads, trl_heads_status
    from .model_handles import handles
    from .packing.collator import PackingCollator
    from .packing.enable import enable_packing, packing_status
    from .registry import PatchError, PatchHandle, StatusRow, StatusTable

# public name -> submodule; imported on first use so that `import model_patches` stays light.
_LAZY: dict[str, str] = {
    # packing
    "enable_packing": "packing.enable",
    "packing_status": "packing.enable",
    "PackingCollator": "packing.collator",
    # packed documents with the sequence sharded over processes
    "enable_context_parallel": "context_parallel",
    "ContextParallelHandle": "context_parallel",
    # the loss path
    "enable_chunked_loss": "loss.chunked_loss",
    "chunked_loss_status": "loss.chunked_loss",
    "causal_lm_loss": "loss.linear_cross_entropy",
    "enable_linear_cross_entropy": "loss.linear_cross_entropy",
    "causal_lm_token_logprobs": "loss.token_losses",
    "causal_lm_distillation_loss": "loss.token_losses",
    "enable_trl_heads": "loss.trl_heads",
    # Trainer's resume restores every weight (with every patch above; on its own too)
    "enable_resume_conversion": "checkpoint_resume",
    "resume_conversion_status": "checkpoint_resume",
    "trl_heads_status": "loss.trl_heads",
    # what they return and raise
    "handles": "model_handles",
    "PatchHandle": "registry",
    "LinearCrossEntropyHandle": "loss.linear_cross_entropy",
    "StatusRow": "registry",
    "StatusTable": "registry",
    "PatchError": "registry",
}

__all__: list[str] = sorted(_LAZY)

#: Old name -> the name that replaced it; importable, with a DeprecationWarning, for one release.
#: The hidden-state form has one name across the packages: ``linear``, as in
#: ``functional_ce.linear_cross_entropy``.
DEPRECATED: dict[str, str] = {
    "enable_hidden_state_loss": "enable_linear_cross_entropy",
    "HiddenStateLossHandle": "LinearCrossEntropyHandle",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if name in DEPRECATED:
        new = DEPRECATED[name]
        warnings.warn(f"model_patches.{name} is deprecated and will be removed in the next release; use "
                      f"model_patches.{new}", DeprecationWarning, stacklevel=2)
        return __getattr__(new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

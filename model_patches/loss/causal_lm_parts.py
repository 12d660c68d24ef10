"""How a stock ``*ForCausalLM`` is taken apart for a loss computed from hidden states: its
decoder and ``lm_head`` (refusing heads whose logits are not ``lm_head(decoder(...))``, then
soft-capping), the decoder's inputs and last hidden state, the shifted labels, and running a
function inside a module's own call so that FSDP2's hooks run around it. Shared by
:mod:`model_patches.loss.linear_cross_entropy` and :mod:`model_patches.loss.token_losses`."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .forward_keywords import LOSS_ONLY_KEYS

__all__ = [
    "VERIFIED_MODEL_TYPES", "decoder_inputs", "head_and_decoder", "inside_call", "is_fsdp_module", "last_hidden_state",
    "module_class", "refuse", "shifted_labels",
]

logger = logging.getLogger(__name__)


#: Model types whose causal-LM forward was checked to be decoder -> lm_head [-> softcap].
VERIFIED_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "gemma", "gemma2", "gemma3_text",
     "mixtral", "phi3", "olmo2", "smollm3"}
)
#: Config attributes of logit transforms this function does not reproduce.
_LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "output_multiplier_scale")
warned_types: set[str] = set()


def refuse(model: nn.Module, why: str, fix: str, who: str = "causal_lm_loss") -> None:
    raise ValueError(f"{who} cannot run {type(model).__name__}: {why}. {fix}")


def head_and_decoder(model: nn.Module, who: str = "causal_lm_loss") -> tuple[nn.Linear, nn.Module]:
    """``model``'s output embedding (a plain ``nn.Linear``) and decoder; refuses, naming ``who``
    (the calling function) in the message, a model whose logits are not ``lm_head(decoder(...))``
    [then ``final_logit_softcapping``]."""
    config = getattr(model, "config", None)
    if config is None:
        refuse(model, "it has no .config", "Pass a Hugging Face *ForCausalLM model", who)
    if getattr(config, "is_encoder_decoder", False):
        refuse(model, "it is an encoder-decoder model", "Use model(**batch, labels=...) for it", who)
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(config, attr, None)
        if value is not None and value != 1.0:
            refuse(
                model,
                f"its forward scales the logits (config.{attr}={value!r}), which this loss does not reproduce",
                "Use model(**batch, labels=...) with model_patches.enable_chunked_loss() instead",
                who,
            )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or module_class(head) is not nn.Linear:
        refuse(
            model,
            f"its output embedding is {type(head).__name__}, not a plain torch.nn.Linear "
            "(wrapped, quantised or missing heads change the logits in ways this loss cannot see)",
            "Use model(**batch, labels=...) with model_patches.enable_chunked_loss() instead",
            who,
        )
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if not isinstance(decoder, nn.Module) or decoder is model:
        refuse(model, "it exposes no decoder (get_decoder() / .model)", "Pass a *ForCausalLM model", who)
    model_type = str(getattr(config, "model_type", ""))
    if model_type not in VERIFIED_MODEL_TYPES and model_type not in warned_types:
        warned_types.add(model_type)
        logger.warning(
            "%s: model_type %r was not verified; assuming logits = lm_head(decoder(...)) "
            "[then final_logit_softcapping]. Compare one step against model(**batch, labels=...) once.",
            who, model_type,
        )
    return head, decoder


def is_fsdp_module(module: nn.Module) -> bool:
    """``module`` was sharded with FSDP2's ``fully_shard`` (its hooks gather its parameters)."""
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def module_class(module: nn.Module) -> type:
    """``module``'s own class: for a module sharded with ``fully_shard`` (whose class FSDP2
    replaces by a subclass), the class it had before."""
    if not is_fsdp_module(module):
        return type(module)
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__[1:] if not issubclass(c, FSDPModule))


def decoder_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The entries of a ``model(...)`` batch that the decoder takes (the loss-only ones removed)."""
    inputs = {k: v for k, v in batch.items() if k not in LOSS_ONLY_KEYS}
    # A loss never needs a KV cache; building one also switches off Transformers' detection of
    # packed rows from position_ids (5.x), which lets packed documents attend to each other.
    inputs.setdefault("use_cache", False)
    return inputs


def last_hidden_state(decoder: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """The decoder's last hidden state ``[B, T, H]`` (its own dtype)."""
    out = decoder(**inputs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def shifted_labels(
    labels: Optional[torch.Tensor], shift_labels: Optional[torch.Tensor], ignore_index: int, device: torch.device
) -> torch.Tensor:
    """Labels aligned with the positions that predict them, ``[B, T]`` on ``device``:
    ``shift_labels`` as given, else ``labels`` shifted left by one as Transformers does
    (position t scores token t+1; the last position gets ``ignore_index``)."""
    if shift_labels is None:
        shift_labels = F.pad(labels.to(device), (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.to(device)


def inside_call(module: nn.Module, fn: Any) -> Any:
    """``fn()`` run as ``module``'s forward for one call, so the hooks registered on ``module``
    (FSDP2's parameter gathering before, resharding and backward registration after) run
    around it."""
    had_own = "forward" in module.__dict__
    own = module.__dict__.get("forward")
    module.forward = lambda *args, **kwargs: fn()
    try:
        return module()
    finally:
        if had_own:
            module.forward = own
        else:
            del module.forward

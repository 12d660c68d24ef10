"""The peer of ``long_context``: DeepSpeed's single-device ALST pieces on a Hugging Face causal LM.

Snowflake's ALST (Arctic Long Sequence Training) reaches its one-GPU lengths with three pieces that
are pure PyTorch and ship in DeepSpeed (``deepspeed.runtime.sequence_parallel.ulysses_sp``):

- ``TiledMLP`` on every decoder block's ``mlp`` (a MoE block too, whole: its router sees one shard
  at a time, so a recorded router output is per shard), ``ceil(seqlen / hidden)`` shards (the rule
  in its docstring and ArcticTraining's recipes): forward without saving, backward recomputing one
  shard at a time;
- ``TiledFusedLogitsLoss`` for the loss: the head and cross-entropy per shard of tokens, the
  backward run inside forward, shards of about 1 GiB of fp32 logits (ArcticTraining's default);
- Hugging Face gradient checkpointing on the decoder blocks (ALST adds checkpoint offload to host
  memory on CUDA, which is not modelled here: the table's peer rows keep checkpoints on the device).

:func:`apply_deepspeed_tiling` puts them on a model instance (the class is left alone) the way
ALST's patch does on the class; :func:`deepspeed_tiling_available` says whether DeepSpeed imports.
The loss is the mean over the shifted labels that are not ``-100``, as Transformers' own.
"""

from __future__ import annotations

import importlib.util
import math
import types
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

#: The peer's plan name in the train section's tables.
PEER = "deepspeed_tiled"
#: Fp32 logits per ``TiledFusedLogitsLoss`` shard (ArcticTraining's default slice, 1 GiB).
LOGITS_SHARD_BYTES = 2**30
IGNORE_INDEX = -100


def deepspeed_tiling_available() -> bool:
    """Whether DeepSpeed (with ``TiledMLP`` and ``TiledFusedLogitsLoss``) can be imported."""
    if importlib.util.find_spec("deepspeed") is None:
        return False
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP  # noqa: F401
    except ImportError:
        return False
    return True


def _tiled_mlp_forward(original: Any) -> Any:
    def run(module: nn.Module, piece: torch.Tensor) -> torch.Tensor:
        # TiledMLP's backward hands over [tokens, hidden] shards; a MoE block wants [batch, seq, hidden]
        out = original(module, piece.reshape(1, -1, piece.shape[-1]))
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{type(module).__name__} returns {type(out).__name__}: TiledMLP takes modules that "
                            "return one tensor")
        return out.reshape(*piece.shape[:-1], out.shape[-1])

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        shards = max(1, math.ceil(x.shape[-2] / x.shape[-1]))
        params = [p for p in self.parameters() if p.requires_grad]
        return TiledMLP.apply(run, self, x, shards, params)
    return forward


def _tiled_loss_forward(model: nn.Module) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def forward(self: nn.Module, input_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        kwargs.pop("num_items_in_batch", None)
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        if labels is None:
            return CausalLMOutputWithPast(logits=self.lm_head(hidden))
        shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
        count = (shifted != IGNORE_INDEX).sum().clamp(min=1)

        def shard_loss(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            # the shard's share of the mean: TiledFusedLogitsLoss runs backward with gradient 1
            logits = head(x).float()
            return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum") / count

        tokens = hidden.shape[0] * hidden.shape[1]
        shards = max(1, math.ceil(tokens * self.lm_head.out_features * 4 / LOGITS_SHARD_BYTES))
        params = [p for p in self.lm_head.parameters() if p.requires_grad]
        loss = TiledFusedLogitsLoss.apply(shard_loss, self.lm_head, hidden, shifted, None, shards, params, "sum")
        return CausalLMOutputWithPast(loss=loss)

    return forward


def apply_deepspeed_tiling(model: nn.Module) -> nn.Module:
    """``model`` (a Transformers causal LM) with Hugging Face checkpointing, DeepSpeed's
    ``TiledMLP`` on every decoder block's ``mlp`` and ``TiledFusedLogitsLoss`` as its loss; the
    same object, patched on the instance."""
    if not deepspeed_tiling_available():
        raise RuntimeError("the peer's pieces need DeepSpeed: pip install 'lean-llm-train[engines]'")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = model.model.layers
    for layer in layers:
        mlp = layer.mlp
        mlp.forward = types.MethodType(_tiled_mlp_forward(type(mlp).forward), mlp)
    model.forward = types.MethodType(_tiled_loss_forward(model), model)
    return model

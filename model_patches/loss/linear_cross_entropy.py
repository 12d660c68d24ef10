"""``causal_lm_loss(model, **batch)``: a stock ``*ForCausalLM``'s loss without building logits.

Runs the model's decoder (``model.get_decoder()``, i.e. ``model.model``), then
``functional_ce.linear_cross_entropy`` on the output embedding (``lm_head``) weight, with the
same label shift, ``shift_labels``, ``ignore_index`` and ``num_items_in_batch`` handling as
Transformers' ``ForCausalLMLoss`` and the model's ``final_logit_softcapping`` (Gemma 2/3).

Fits models whose forward is ``logits = lm_head(decoder(...).last_hidden_state)`` optionally
followed by soft-capping: Llama, Mistral, Qwen2/3, Qwen3-MoE, Gemma 1/2/3 and others of that
shape. Tied input/output embeddings are handled: the loss uses the shared parameter, and
autograd adds its gradient to the embedding's. A biased ``nn.Linear`` head is handled (the bias
goes to the loss). Heads that transform logits in other ways (Cohere's ``logit_scale``,
Granite's ``logits_scaling``), heads that are not an ``nn.Linear``, encoder-decoder models and
MoE models asked to add a router auxiliary loss are refused with the reason.

FSDP2: on a model sharded with ``fully_shard`` (each decoder layer and the root, the usual
recipe), the loss runs *inside* the root's forward call (the model's ``forward`` is replaced
for that one call), so FSDP2's own hooks gather the root's parameters (embeddings, final norm,
``lm_head``) once before it, reshard them after it, and register the backward that reduces every
gradient, the LM head's included, as FSDP2 always does (the mean over processes). One full
``lm_head`` weight exists during the step, exactly as FSDP2's own unshard makes it for
``model(**batch)``. The loss is this process's own (a plain tensor). An ``lm_head`` sharded with
its own ``fully_shard`` is handled the same way, inside the head's call.
"""

from __future__ import annotations

import inspect
import logging
import threading
import types
import weakref
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

import functional_ce
from functional_ce.spec import ChunkSize
from patch_layer import ForwardPatch, Handle, holder_of, track, tracked

from ..checkpoint_resume import RESUME_RECORDS, RESUME_WHAT
from ..registry import apply_records
from .causal_lm_parts import (
    VERIFIED_MODEL_TYPES,
    decoder_inputs,
    head_and_decoder,
    inside_call,
    is_fsdp_module,
    last_hidden_state,
    module_class,
    refuse,
    shifted_labels,
)
from .forward_keywords import as_keywords, model_keywords, refuse_unknown_keywords
from .per_model_state import ModelScope, ReleaseWithModel
from .trl_heads import refuse_unrouted_trl_heads
from .unused_loss_watch import TRAINER_HEAD_FIX, LossUseWatch, loss_reached, trainer_fused_head

__all__ = [
    "VERIFIED_MODEL_TYPES",
    "LinearCrossEntropyForward",
    "LinearCrossEntropyHandle",
    "causal_lm_loss",
    "enable_linear_cross_entropy",
]

logger = logging.getLogger(__name__)

#: Set while the forward patched by :func:`enable_linear_cross_entropy` runs: the model's own call
#: (and its FSDP2 hooks) is already under way, so :func:`causal_lm_loss` must not call it again.
_IN_MODEL_CALL = threading.local()


def causal_lm_loss(
    model: nn.Module,
    *,
    chunk_size: ChunkSize = "auto",
    compile_chunks: Optional[bool] = None,
    **batch: Any,
) -> torch.Tensor:
    """The loss ``model(**batch).loss`` would give, computed from hidden states.

    Args:
        model: a Hugging Face ``*ForCausalLM`` (decoder + ``lm_head``).
        chunk_size, compile_chunks: passed to :func:`functional_ce.linear_cross_entropy`.
        **batch: what you would pass to ``model(...)``: ``input_ids`` or ``inputs_embeds``,
            ``attention_mask``, ``position_ids``, ... and ``labels`` ``[B, T]`` (unshifted) or
            ``shift_labels`` ``[B, T]`` (already aligned, e.g. packed rows), optionally
            ``num_items_in_batch`` (sum / this count instead of the mean) and ``ignore_index``.
            ``use_cache`` defaults to False here (``model(...)`` defaults to the config's value).

    Returns:
        fp32 scalar loss. The ``[B, T, V]`` logits are never built.

    Raises:
        ValueError: a model whose structure does not fit (see the module docstring), or a batch
            without ``labels``/``shift_labels``.
    """
    head, decoder = head_and_decoder(model)
    labels = batch.get("labels")
    shift_labels = batch.get("shift_labels")
    num_items = batch.get("num_items_in_batch")
    ignore_index = int(batch.get("ignore_index", -100))
    if labels is None and shift_labels is None:
        raise ValueError("causal_lm_loss needs labels=[B, T] or shift_labels=[B, T] in the batch, got neither")
    config = model.config
    if batch.get("output_router_logits", getattr(config, "output_router_logits", False)):
        refuse(
            model,
            "output_router_logits is on, so its loss would include the router auxiliary loss, which "
            "this function does not add",
            "Pass output_router_logits=False and add the auxiliary loss from the decoder's router_logits yourself",
        )
    inputs = decoder_inputs(batch)
    step = lambda: _loss_from_decoder(model, head, decoder, inputs, labels, shift_labels, num_items,  # noqa: E731
                                      ignore_index, chunk_size, compile_chunks)
    in_model_call = getattr(_IN_MODEL_CALL, "active", False)  # called from the patched forward
    return inside_call(model, step) if is_fsdp_module(model) and not in_model_call else step()


def _loss_from_decoder(
    model: nn.Module, head: nn.Linear, decoder: nn.Module, inputs: dict[str, Any], labels: Any, shift_labels: Any,
    num_items: Any, ignore_index: int, chunk_size: ChunkSize, compile_chunks: Optional[bool],
) -> torch.Tensor:
    """The decoder's last hidden state, then the hidden-state loss on the output embedding."""
    config = model.config
    loss_reached()
    hidden = last_hidden_state(decoder, inputs)
    shift_labels = shifted_labels(labels, shift_labels, ignore_index, hidden.device)
    softcap = getattr(config, "final_logit_softcapping", None)
    if isinstance(num_items, torch.Tensor):
        num_items = num_items.to(hidden.device)

    def head_loss() -> torch.Tensor:
        weight = head.weight  # the gathered parameter inside an FSDP2 head's call
        h = hidden.to(weight.dtype) if hidden.dtype != weight.dtype else hidden  # e.g. fp32 norm under autocast
        kwargs: dict[str, Any] = dict(
            bias=head.bias, ignore_index=ignore_index, softcap=softcap, chunk_size=chunk_size,
            compile_chunks=compile_chunks,
        )
        if num_items is None:
            return functional_ce.linear_cross_entropy(h, weight, shift_labels, reduction="mean", **kwargs)
        return functional_ce.linear_cross_entropy(
            h, weight, shift_labels, reduction="sum", num_label_tokens=num_items, **kwargs
        )

    return inside_call(head, head_loss) if is_fsdp_module(head) else head_loss()


class LinearCrossEntropyForward:
    """The instance ``forward`` that :func:`enable_linear_cross_entropy` installs: the loss from hidden
    states in training calls with labels, the forward it replaced otherwise.

    It is an object that belongs to its model, not a closure over it: ``copy.deepcopy`` of the model
    (TRL's reference models, EMA and teacher copies) gives the copy a patch of its own, bound to the
    copy's weights, with its own call watch, its own refusal of TRL's kernels and its own handle
    (:func:`model_patches.handles`); pickling (``torch.save(model)``) stores it with the model and
    re-creates the same in the process that loads it (with this library installed). Removing one
    model's patch never touches the other's. A forward under the patch that is a closure (code
    installed before the patch that calls the original model) cannot be copied: copying refuses it.

    Attributes:
        model: the patched model; ``options``: ``chunk_size`` and ``compile_chunks``;
        ``own``: the instance ``forward`` the model had before the patch, or None (its class's);
        ``scope``, ``watch``: the call scope of the TRL refusal and the loss-use watch (forward
        hooks on the model, copied with it); ``handle``: the undo handle (made again in each copy).
    """

    def __init__(self, model: nn.Module, options: dict[str, Any], own: Any, scope: ModelScope,
                 watch: LossUseWatch) -> None:
        self.model, self.options, self.own = model, options, own
        self.scope, self.watch = scope, watch
        watch.adopted = True  # a copy's watch comes with this patch
        self._signature: Optional[inspect.Signature] = None
        self._known: Optional[frozenset] = None
        refusal = refuse_unrouted_trl_heads(
            f"enable_linear_cross_entropy is active on {type(model).__name__}, but TRL's fused kernel is computing a "
            f"loss from hidden states instead, so the patch is silently unused. {TRAINER_HEAD_FIX}",
            model=model, scope=scope,
        )
        self.handle = LinearCrossEntropyHandle(model, self, (apply_records(RESUME_RECORDS, strict=False, what=RESUME_WHAT), scope, refusal, watch))
        track(model, self.handle)

    @property
    def previous(self) -> Any:
        """The instance forward the patch replaced (None: the class's), as :class:`patch_layer.ForwardPatch` reads it."""
        return self.own

    def below(self) -> Any:
        """What the patch calls outside its loss path: the forward it replaced."""
        return self.own if self.own is not None else types.MethodType(type(self.model).forward, self.model)

    @property
    def __wrapped__(self) -> Any:
        return self.below()

    @property
    def __signature__(self) -> inspect.Signature:
        # the model's own signature: Trainer reads it to keep the batch's columns and to decide
        # whether to pass num_items_in_batch
        if self._signature is None:
            self._signature = inspect.signature(self.below())
        return self._signature

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        if args:
            kwargs = as_keywords(self.__signature__, args, kwargs)
        has_labels = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        if not (has_labels and model.training and torch.is_grad_enabled()):
            return self.below()(**kwargs)
        if self._known is None:
            self._known = model_keywords(module_class(model))
        refuse_unknown_keywords(model, self._known, kwargs)
        return_dict = kwargs.pop("return_dict", None)
        _IN_MODEL_CALL.active = True
        try:
            loss = causal_lm_loss(model, **self.options, **kwargs)
        finally:
            _IN_MODEL_CALL.active = False
        if return_dict is False:
            return (loss,)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=None)

    def __getstate__(self) -> dict[str, Any]:
        top = self.model.__dict__.get("forward")
        for where, fn in (("under the patch", self.own), ("installed on top of the patch", top)):
            function = getattr(fn, "__func__", fn)
            shared = isinstance(function, types.FunctionType) and bool(function.__closure__)
            if shared and (fn is self.own or holder_of(fn, self) is not None):
                raise TypeError(
                    f"{type(self.model).__name__} cannot be copied with enable_linear_cross_entropy on it: the forward "
                    f"{where} ({function.__qualname__}) is a closure, which a copy would share with the original "
                    "and so run the original's weights (Accelerate's mixed-precision wrapper, which Trainer installs "
                    "at train(), is one). Copy the model before that code wraps it, or remove the patch "
                    "(model_patches.handles(model)) and that code first, then enable the patch on the copy"
                )
        return {k: getattr(self, k) for k in ("model", "options", "own", "scope", "watch")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"<LinearCrossEntropyForward of {type(self.model).__name__}>"


class LinearCrossEntropyHandle(Handle):
    """Undo handle of :func:`enable_linear_cross_entropy`; also a context manager.

    Removing twice is a no-op. If the model's ``forward`` was replaced after the patch (a
    trainer or another library wrapping it, such as TRL's fused head or Accelerate's mixed
    precision), ``remove()`` takes the patch out from under that code when it holds the patched
    forward in a closure or a callable object, directly or down a ``__wrapped__`` chain (the usual
    ways of wrapping: it then calls the forward the patch wrapped); otherwise it raises
    ``ValueError`` and changes nothing, since putting the original back would delete that code.

    The handle holds the model weakly: it never keeps the model alive, and when the model is
    garbage-collected it removes itself (the refusal of TRL's kernels for that model goes with it).
    A copy of the model has a handle of its own (:func:`model_patches.handles`).
    """

    def __init__(self, model: nn.Module, replacement: LinearCrossEntropyForward, companions: Sequence[Handle] = ()) -> None:
        # the call scope and watch and the TRL-head refusal, removed with the patch, and the removal when the model is collected
        super().__init__([*companions, ReleaseWithModel(model, self)], forwards=[ForwardPatch.of(model, replacement)])
        self._model = weakref.ref(model)
        self._name = type(model).__name__

    def _describe(self) -> str:
        return f"{self._name}.forward" + ("" if self._model() is not None else " (model collected)")


def enable_linear_cross_entropy(
    model: nn.Module, *, chunk_size: ChunkSize = "auto", compile_chunks: Optional[bool] = None
) -> LinearCrossEntropyHandle:
    """Make ``model(**batch, labels=...)`` compute its loss with :func:`causal_lm_loss` while training.

    While the model is in training mode with gradients enabled and the call carries ``labels`` or
    ``shift_labels``, the forward returns ``CausalLMOutputWithPast(loss=..., logits=None)``: no
    logits are built (``num_items_in_batch``, as Hugging Face ``Trainer`` passes it for gradient
    accumulation, divides the summed loss as in Transformers). Every other call (evaluation,
    ``torch.no_grad()``, generation, no labels) runs the model's own forward unchanged, with every
    keyword passed through. In the loss path a keyword the model's forward does not take is
    refused by name (the path runs the decoder, so it would skip the code the keyword is for).

    Used or refused: a trainer's own fused LM head (TRL's ``add_fused_lm_head``, which every TRL
    trainer installs) computes the loss without calling this patch. Installed already, it is
    refused here; installed later, the first call that asks it for its output
    (``fused_lm_head=True``) is refused, unless :func:`model_patches.enable_trl_heads` routes
    that head through ``functional_ce``; so are TRL's fused kernels computing for this model
    while TRL's heads are not routed (the distillation trainer calls them without the model's
    loss). The refusal concerns this model only: other models train with TRL's own kernels. Any
    other training call with labels that finishes without reaching this loss is reported once per
    model (``UserWarning`` and a log record). With TRL installed, enabling imports
    ``trl.trainer.utils`` (about 2 s the first time).

    Lifetime: the handle holds the model weakly, and a model that is garbage-collected takes the
    patch's process-wide state (the refusal of TRL's kernels) with it, even if ``remove()`` was
    never called.

    Args:
        model: a ``*ForCausalLM`` that :func:`causal_lm_loss` supports (checked now).
        chunk_size, compile_chunks: passed to :func:`functional_ce.linear_cross_entropy`.

    Returns:
        The undo handle (``remove()``, or use it as a context manager).

    Raises:
        ValueError: a model :func:`causal_lm_loss` cannot run (named with the reason), one whose
            config asks for router auxiliary losses, one already patched, or one whose loss a
            trainer's fused head computes.
    """
    head_and_decoder(model, "enable_linear_cross_entropy")
    if getattr(model.config, "output_router_logits", False):
        refuse(model, "config.output_router_logits is on, so its loss would include the router auxiliary "
                "loss, which this function does not add", "Set config.output_router_logits=False")
    if any(isinstance(h, LinearCrossEntropyHandle) for h in tracked(model)):
        raise ValueError(f"enable_linear_cross_entropy: {type(model).__name__} is already patched; remove that "
                         "handle first (model_patches.handles(model) finds it)")
    head = trainer_fused_head(model)
    if head is not None:
        refuse(model, f"{head} is installed on it and computes its training loss from the decoder's hidden "
                "states itself, so this patch would never run", TRAINER_HEAD_FIX, "enable_linear_cross_entropy")
    forward = LinearCrossEntropyForward(
        model, dict(chunk_size=chunk_size, compile_chunks=compile_chunks), model.__dict__.get("forward"),
        ModelScope(model), LossUseWatch(model, "enable_linear_cross_entropy", TRAINER_HEAD_FIX),
    )
    model.forward = forward
    return forward.handle

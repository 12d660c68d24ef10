"""Losses over the vocabulary whose memory does not grow with tokens x vocabulary.

``cross_entropy`` works from logits, ``linear_cross_entropy`` from hidden states (it never builds
the logits); ``CrossEntropyLoss`` / ``LinearCrossEntropyLoss`` are their ``nn.Module`` forms.
``token_logprobs`` (with entropy) and ``distillation_loss`` (TRL GKD's generalized JSD), and their
``linear_*`` hidden-state forms, run on the same chunk driver.
All take DTensors sharded over the vocabulary (tensor parallelism) and FSDP2-sharded heads
(:mod:`functional_ce.distributed`), and serve as a pipeline's last-stage ``loss_fn``
(:func:`pipeline_loss_fn`).

Layout: :mod:`~functional_ce.loss` and :mod:`~functional_ce.token_losses` (the public functions),
:mod:`~functional_ce.modules` (the ``nn.Module`` forms), :mod:`~functional_ce.spec` and
:mod:`~functional_ce.inputs` (the options, the per-token inputs and their checks, mean / sum / none),
:mod:`~functional_ce.maths` (each loss's pure per-chunk maths), :mod:`~functional_ce.chunk` (the
graphs torch.compile sees per chunk, and cross-entropy's ``chunk_forward`` / ``chunk_backward``),
:mod:`~functional_ce.compiled_chunks` (the compile cache: one compiled graph per configuration),
:mod:`~functional_ce.operators` (each step as a custom operator, and ``loss_rows``, the entry every
loss calls), :mod:`~functional_ce.driver` (the loop over chunks and the fp32 weight-gradient
accumulation), :mod:`~functional_ce.distributed` (vocabulary
parallelism, FSDP2, pipeline ``loss_fn``). This package never imports ``transformers``.
"""

from .chunk import chunk_backward, chunk_forward
from .distributed.pipeline import hidden_state_loss_fn as hidden_state_loss_fn  # deprecated, kept out of __all__
from .distributed.pipeline import pipeline_loss_fn
from .loss import cross_entropy, linear_cross_entropy
from .modules import CrossEntropyLoss, LinearCrossEntropyLoss
from .spec import LossSpec
from .token_losses import distillation_loss, linear_distillation_loss, linear_token_logprobs, token_logprobs

__all__ = [
    "CrossEntropyLoss",
    "LinearCrossEntropyLoss",
    "LossSpec",
    "chunk_backward",
    "chunk_forward",
    "cross_entropy",
    "distillation_loss",
    "linear_cross_entropy",
    "linear_distillation_loss",
    "linear_token_logprobs",
    "pipeline_loss_fn",
    "token_logprobs",
]


def __getattr__(name: str):
    if name == "ChunkOptions":  # deprecated alias of LossSpec; spec's __getattr__ warns
        from . import spec

        return spec.ChunkOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

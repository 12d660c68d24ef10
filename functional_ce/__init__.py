"""Losses over the vocabulary whose memory does not grow with tokens x vocabulary.

``cross_entropy`` works from logits, ``linear_cross_entropy`` from hidden states (it never builds
the logits); ``CrossEntropyLoss`` / ``LinearCrossEntropyLoss`` are their ``nn.Module`` forms.
``token_logprobs`` (with entropy) and ``distillation_loss`` (TRL GKD's generalized JSD), and their
``linear_*`` hidden-state forms, run on the same chunk driver.
Both take DTensors sharded over the vocabulary (tensor parallelism) and FSDP2-sharded heads
(:mod:`functional_ce.distributed`). Layout: ``loss`` (the public functions), ``spec`` (the
options and their checks), ``chunk`` (the pure per-chunk maths, the graphs torch.compile sees),
``driver`` (the chunk loop and its operators), ``distributed``. This package never imports
``transformers``.
"""

from .chunk import chunk_backward, chunk_forward
from .distributed.pipeline import hidden_state_loss_fn, pipeline_loss_fn
from .loss import cross_entropy, linear_cross_entropy
from .modules import CrossEntropyLoss, LinearCrossEntropyLoss
from .spec import ChunkOptions, LossSpec
from .token_losses import distillation_loss, linear_distillation_loss, linear_token_logprobs, token_logprobs

__all__ = [
    "ChunkOptions",
    "CrossEntropyLoss",
    "LinearCrossEntropyLoss",
    "LossSpec",
    "chunk_backward",
    "chunk_forward",
    "cross_entropy",
    "distillation_loss",
    "hidden_state_loss_fn",
    "linear_cross_entropy",
    "linear_distillation_loss",
    "linear_token_logprobs",
    "pipeline_loss_fn",
    "token_logprobs",
]

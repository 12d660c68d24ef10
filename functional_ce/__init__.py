"""Cross-entropy whose memory does not grow with tokens x vocabulary.

``cross_entropy`` works from logits, ``linear_cross_entropy`` from hidden states (it never builds
the logits); ``CrossEntropyLoss`` / ``LinearCrossEntropyLoss`` are their ``nn.Module`` forms. The
per-chunk functions ``chunk_forward`` and ``chunk_backward`` are the pure graphs that
torch.compile sees. Both loss forms take DTensors sharded over the vocabulary (tensor
parallelism, :mod:`functional_ce.vocab_parallel`). This package never imports ``transformers``.
"""

from .chunk import chunk_backward, chunk_forward
from .linear_loss import linear_cross_entropy
from .loss import cross_entropy
from .modules import CrossEntropyLoss, LinearCrossEntropyLoss
from .pipeline import hidden_state_loss_fn
from .options import ChunkOptions

__all__ = [
    "ChunkOptions",
    "CrossEntropyLoss",
    "LinearCrossEntropyLoss",
    "chunk_backward",
    "chunk_forward",
    "cross_entropy",
    "hidden_state_loss_fn",
    "linear_cross_entropy",
]

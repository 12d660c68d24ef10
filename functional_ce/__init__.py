"""Cross-entropy whose memory does not grow with tokens x vocabulary.

``cross_entropy`` works from logits; the per-chunk functions ``chunk_forward`` and
``chunk_backward`` are the pure graphs that torch.compile sees. This package never imports
``transformers``.
"""

from .chunk import chunk_backward, chunk_forward
from .linear_loss import linear_cross_entropy
from .loss import cross_entropy
from .options import ChunkOptions

__all__ = ["ChunkOptions", "chunk_backward", "chunk_forward", "cross_entropy", "linear_cross_entropy"]

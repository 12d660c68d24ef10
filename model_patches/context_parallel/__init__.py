"""Context parallelism for packed documents: the sequence sharded over a process group, every
document still alone (:func:`enable_context_parallel`)."""

from .enable import ContextParallelHandle, enable_context_parallel, simulate_context_parallel
from .layout import DocumentLayout, document_ids, pairs_per_rank

__all__ = ["ContextParallelHandle", "DocumentLayout", "document_ids", "enable_context_parallel", "pairs_per_rank",
           "simulate_context_parallel"]

"""Test tooling that ships with model_patches, for its own tests, the bench and users' checks.

- :mod:`.flash_double`: a CPU stand-in for the flash-attention kernels that keeps Transformers'
  real flash code path (``cpu_flash_attention``, ``use_attention``).
- :mod:`.tiny_models`: the one factory of tiny random-init models (``tiny_causal_lm``).
- :mod:`.packing_oracle`: a packed row must equal each of its documents run alone.
- :mod:`.family_sweep`: that oracle over every causal-LM family Transformers can build.
"""

from .flash_double import cpu_flash_attention, sdpa_flash_attn_func, sdpa_flash_attn_varlen_func, use_attention
from .tiny_models import tiny_causal_lm, tiny_config

__all__ = [
    "cpu_flash_attention",
    "use_attention",
    "sdpa_flash_attn_func",
    "sdpa_flash_attn_varlen_func",
    "tiny_causal_lm",
    "tiny_config",
]

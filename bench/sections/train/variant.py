"""What one ``train`` variant changes against stock (the worker runs it; the variant tables and the
``SFTTrainer`` builder name it), apart from the worker so that each can import it."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a variant changes against stock (see the module docstring)."""

    hf_gc: bool = False
    hidden_loss: bool = False
    policy: Optional[str] = None
    fit: Optional[float] = None
    packing: bool = False
    wrong: Optional[str] = None
    #: "hf": ``transformers.Trainer``; "sft": ``trl.SFTTrainer`` (TRL's fused LM head; padding by TRL's
    #: collator, or the library's ``PackingCollator`` with ``packing``; ``hidden_loss`` also routes TRL's
    #: head through functional_ce with ``model_patches.enable_trl_heads()``, which the hidden-state loss needs)
    trainer: str = "hf"

    def __post_init__(self) -> None:
        if self.trainer not in ("hf", "sft"):
            raise ValueError(f"trainer must be 'hf' (transformers.Trainer) or 'sft' (trl.SFTTrainer), got "
                             f"{self.trainer!r}")
        if self.hf_gc and (self.policy or self.fit):
            raise ValueError("a variant takes Hugging Face gradient checkpointing or an ac_policies policy, not both")
        if self.policy and self.fit:
            raise ValueError("a variant takes a preset policy or a fit() budget, not both")
        if self.wrong not in (None, "lr", "drop_token"):
            raise ValueError(f"wrong must be None, 'lr' or 'drop_token', got {self.wrong!r}")

    @property
    def checkpointing(self) -> str:
        """The checkpointing this variant uses, as the report groups variants: none, hf or ac."""
        return "hf" if self.hf_gc else "ac" if (self.policy or self.fit) else "none"

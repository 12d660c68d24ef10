"""Checkpointing twice: a policy combined with Hugging Face's own gradient checkpointing or with
torch's ``checkpoint_wrapper`` (Accelerate's FSDP activation checkpointing).

:func:`lineage` names the modules where another mechanism around, on or under a wrapped module
shows up; the finders return the first such module, and the error builders give the one message
for each case, with the fix.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

__all__ = [
    "double_checkpointing_error",
    "find_checkpoint_wrapper",
    "find_hf_flagged",
    "lineage",
    "trainer_checkpointing_argument",
    "with_hf_flag",
    "wrapper_checkpointing_error",
]


def find_hf_flagged(modules: list[tuple[str, nn.Module]], training: bool = True) -> Optional[tuple[str, nn.Module]]:
    """The first module with Hugging Face gradient checkpointing switched on (and, if ``training``, in training mode)."""
    for fqn, m in modules:
        if getattr(m, "gradient_checkpointing", False) is True and (m.training or not training):
            return fqn, m
    return None


def trainer_checkpointing_argument() -> str:
    """The training argument that keeps ``Trainer.train()`` (and TRL's trainers) from turning
    Hugging Face checkpointing on: ``activation_checkpointing`` where the installed Transformers'
    ``TrainingArguments`` has it (5.25 among the tested releases; not 5.22 or 4.57), else
    ``gradient_checkpointing``."""
    import transformers

    fields = getattr(transformers.TrainingArguments, "__dataclass_fields__", {})
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def double_checkpointing_error(fqn: str, module: nn.Module) -> ValueError:
    """The one message for a policy combined with Hugging Face's own gradient checkpointing."""
    argument = trainer_checkpointing_argument()
    return ValueError(
        f"activation checkpointing twice: Hugging Face gradient checkpointing is enabled on {fqn or '<root>'} "
        f"({type(module).__name__}) and an ac_policies policy wraps modules in or around it, so they would be "
        "recomputed twice. Use one. Under transformers.Trainer or TRL's trainers, train() turns Hugging Face's "
        f"checkpointing on from the training arguments: pass {argument}=False in TrainingArguments / SFTConfig "
        "(TRL's configs default gradient_checkpointing to True; calling model.gradient_checkpointing_disable() "
        f"before train() is undone by train()). Outside a trainer: model.{argument}_disable(). "
        "Or remove the policy with handle.remove()."
    )


def find_checkpoint_wrapper(modules: list[nn.Module]) -> Optional[nn.Module]:
    """The first of ``modules`` or of their children that is torch's ``checkpoint_wrapper`` (it keeps
    the module it wraps as ``_checkpoint_wrapped_module``; Accelerate's FSDP activation
    checkpointing and ``apply_activation_checkpointing`` wrap modules with it)."""
    for m in modules:
        if hasattr(m, "_checkpoint_wrapped_module"):
            return m
        for child in m._modules.values():
            if child is not None and hasattr(child, "_checkpoint_wrapped_module"):
                return child
    return None


def wrapper_checkpointing_error(wrapper: nn.Module) -> ValueError:
    """The one message for a policy combined with torch's ``checkpoint_wrapper`` (Accelerate's FSDP
    activation checkpointing)."""
    inner = type(getattr(wrapper, "_checkpoint_wrapped_module", wrapper)).__name__
    return ValueError(
        f"activation checkpointing twice: {inner} is wrapped by torch's checkpoint_wrapper ({type(wrapper).__name__}, "
        "what Accelerate's FSDP activation checkpointing and torch's apply_activation_checkpointing install) and an "
        "ac_policies policy wraps modules in the same model, so they would be recomputed twice. Use one: to keep the "
        "policy, turn Accelerate's off: fsdp_activation_checkpointing: false in the Accelerate config file, "
        "fsdp_config={'activation_checkpointing': False} in TrainingArguments / SFTConfig, or "
        "FullyShardedDataParallelPlugin(activation_checkpointing=False); or remove the policy with handle.remove()."
    )


def lineage(model: nn.Module, fqn: str) -> list[tuple[str, nn.Module]]:
    """The module, its ancestors (closest first), then its descendants, by name: where another
    checkpointing mechanism around, on or under it shows up."""
    parts = fqn.split(".") if fqn else []
    chain = [".".join(parts[:k]) for k in range(len(parts), -1, -1)]
    found = [(a, model.get_submodule(a)) for a in chain]
    return found + [(f"{fqn}.{n}" if fqn else n, m) for n, m in model.get_submodule(fqn).named_modules() if n]


def with_hf_flag(lineage: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The modules of ``lineage`` carrying an HF ``gradient_checkpointing`` flag; the first one
    switched on names the double checkpointing."""
    return [(n, m) for n, m in lineage if hasattr(m, "gradient_checkpointing")]


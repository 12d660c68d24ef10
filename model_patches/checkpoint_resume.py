"""``Trainer`` resumes restore every weight: checkpoints written in the Hub layout are converted back.

Since Transformers 5.0, ``save_pretrained`` writes checkpoints in the Hub layout: a MoE model's
fused ``experts.gate_up_proj`` / ``experts.down_proj`` are saved as per-expert tensors, and some
families rename modules on the way (Mixtral's ``mlp`` is saved as ``block_sparse_moe``).
``Trainer._load_from_checkpoint`` (``resume_from_checkpoint``) and ``Trainer._load_best_model``
(``load_best_model_at_end``) load those files with ``load_state_dict(strict=False)``, without the
conversion ``from_pretrained`` applies, so the experts (and Mixtral's routers) silently keep the
fresh model's weights (Transformers issue #48805; the fix, PR #48822, is open as of 5.25).

The records here wrap both methods. After the original load, the model is checked against the
files: its state dict, converted to the Hub layout by Transformers' own save-side
``revert_weight_conversion``, must equal every saved tensor. Where it does (a dense model, or a
release whose Trainer converts), nothing more happens. Where it does not, the checkpoint is
converted to the model's layout by Transformers' own load-side ``convert_and_load_state_dict_in_model``
(into a shell of the model on the meta device, so the model's parameters are copied into in place
and keep their identity and ``requires_grad``), loaded, and checked again; a model that still
disagrees with its checkpoint raises. FSDP, DeepSpeed and PEFT adapter checkpoints take their own
loading paths and are left to them.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any, Callable, Optional

import torch

from .registry import PatchHandle, PatchRecord, StatusTable, apply_records, is_applied, record_status
from .targets import parameters_probe

__all__ = ["RESUME_RECORDS", "enable_resume_conversion", "resume_conversion_status", "restore_checkpoint_layout"]

logger = logging.getLogger(__name__)

_LOAD = "transformers.trainer:Trainer._load_from_checkpoint"
_BEST = "transformers.trainer:Trainer._load_best_model"


def _conversion_functions() -> tuple[Callable, Callable, Callable, Any]:
    """Transformers' save-side and load-side conversions (5.0+): ``revert_weight_conversion``,
    ``convert_and_load_state_dict_in_model``, ``get_model_conversion_mapping``, ``LoadStateDictConfig``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model, revert_weight_conversion
    from transformers.modeling_utils import LoadStateDictConfig

    return revert_weight_conversion, convert_and_load_state_dict_in_model, get_model_conversion_mapping, LoadStateDictConfig


def _probe(first: tuple[str, ...]) -> Callable[[Any], Optional[str]]:
    def probe(method: Any) -> Optional[str]:
        reason = parameters_probe(method, first=first)
        if reason:
            return reason
        try:
            revert, convert, mapping, config = _conversion_functions()
        except ImportError as exc:
            return f"Transformers' weight conversion functions cannot be imported ({exc})"
        for fn, params in ((revert, ("model", "state_dict")), (convert, ("model", "state_dict", "load_config")),
                           (mapping, ("model",))):
            reason = parameters_probe(fn, first=params)
            if reason:
                return f"{fn.__name__}: {reason}"
        if "weight_mapping" not in getattr(config, "__dataclass_fields__", {}):
            return "LoadStateDictConfig has no weight_mapping field"
        return None

    probe.__name__ = f"resume_probe[{', '.join(first)}]"
    return probe


def _read_checkpoint(folder: str) -> Optional[dict[str, torch.Tensor]]:
    """The full-model tensors saved in ``folder`` (``model.safetensors``, its sharded index, or
    ``pytorch_model.bin``), or None when it holds none (adapters, FSDP or DeepSpeed states)."""
    import safetensors.torch

    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    legacy = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(single):
        return safetensors.torch.load_file(single, device="cpu")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        saved: dict[str, torch.Tensor] = {}
        for shard in shards:
            saved.update(safetensors.torch.load_file(os.path.join(folder, shard), device="cpu"))
        return saved
    if os.path.isfile(legacy):
        return torch.load(legacy, map_location="cpu", weights_only=True)
    return None


def _saved_names(folder: str) -> Optional[set[str]]:
    """The names of the tensors saved in ``folder``'s safetensors files, read from their headers
    (no tensor loaded); None for other checkpoints."""
    from safetensors import safe_open

    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return set(f.keys())
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    return None


def _disagreements(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> list[str]:
    """The saved tensors the model does not hold: its state dict in the Hub layout, key by key."""
    revert = _conversion_functions()[0]
    current = revert(model, dict(model.state_dict()))
    return [k for k, v in saved.items() if k not in current or not torch.equal(current[k].to(v.device, v.dtype), v)]


def _converted(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``saved`` in the model's own layout, converted by Transformers' load path into a meta-device
    shell of the model. Raises when the conversion leaves saved tensors unused or mismatched."""
    _, convert, mapping, config_type = _conversion_functions()
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    with torch.device("meta"):
        shell = type(model)(model.config)
    shell.to(dtype)
    info, _ = convert(shell, dict(saved), config_type(weight_mapping=mapping(shell), device_map={"": "cpu"}))
    problems = {name: sorted(map(str, getattr(info, name, ()) or ()))[:5]
                for name in ("unexpected_keys", "mismatched_keys") if getattr(info, name, None)}
    if getattr(info, "conversion_errors", None):
        problems["conversion_errors"] = sorted(map(str, info.conversion_errors))[:5]
    if problems:
        raise RuntimeError(f"the checkpoint does not convert to {type(model).__name__}'s layout: {problems}")
    return {k: v for k, v in shell.state_dict().items() if v.device.type != "meta"}


def restore_checkpoint_layout(model: torch.nn.Module, folder: str) -> int:
    """Make ``model`` hold exactly what ``folder`` saved, converting the Hub layout back to the
    model's where Transformers' loader did not; returns the number of saved tensors that had to be
    restored (0 when the model already agreed, or when ``folder`` holds no full-model weights).

    Raises:
        RuntimeError: the model still disagrees with the checkpoint after the conversion (names the
            tensors), so the resumed run would train other weights than the saved ones.
    """
    names = _saved_names(folder)
    if names is not None and names <= model.state_dict().keys():
        return 0  # saved in the model's own layout: Trainer's load_state_dict put every tensor in place by name
    saved = _read_checkpoint(folder)
    if saved is None:
        return 0
    wrong = _disagreements(model, saved)
    if not wrong:
        return 0
    try:
        converted = _converted(model, saved)
        model.load_state_dict(converted, strict=False)
        still = _disagreements(model, saved)
    except Exception as exc:  # noqa: BLE001 - re-raised with what it means for the run
        raise RuntimeError(
            f"resuming {type(model).__name__} from {folder}: {len(wrong)} saved tensor(s) ({', '.join(wrong[:3])}, ...) "
            f"were not loaded by Trainer, and converting the checkpoint to the model's layout failed: {exc}. The run "
            "would continue from other weights than the saved ones; load the checkpoint with "
            "from_pretrained(folder) instead"
        ) from exc
    if still:
        raise RuntimeError(
            f"resuming {type(model).__name__} from {folder}: after converting the checkpoint to the model's layout, "
            f"{len(still)} saved tensor(s) still differ from the model's ({', '.join(still[:3])}, ...); the run would "
            "continue from other weights than the saved ones. Load the checkpoint with from_pretrained(folder) instead"
        )
    logger.info("restored %d tensor(s) of %s that Trainer did not load from %s (converted from the Hub layout)",
                len(wrong), type(model).__name__, folder)
    return len(wrong)


def _own_weights(trainer: Any, model: torch.nn.Module) -> bool:
    """Whether Trainer loaded full-model weights itself (not FSDP, DeepSpeed or a PEFT adapter)."""
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        return False
    return not hasattr(model, "peft_config")


def _build_load(original: Callable) -> Callable:
    @functools.wraps(original)
    def _load_from_checkpoint(self: Any, resume_from_checkpoint: str, model: Optional[torch.nn.Module] = None) -> Any:
        result = original(self, resume_from_checkpoint, model)
        target = self.model if model is None else model
        if is_applied(_LOAD) and _own_weights(self, target):
            restore_checkpoint_layout(target, resume_from_checkpoint)
        return result

    return _load_from_checkpoint


def _build_best(original: Callable) -> Callable:
    @functools.wraps(original)
    def _load_best_model(self: Any) -> Any:
        result = original(self)
        if is_applied(_BEST) and _own_weights(self, self.model):
            restore_checkpoint_layout(self.model, self.state.best_model_checkpoint)
        return result

    return _load_best_model


_WHY = ("save_pretrained writes the Hub layout (per-expert tensors, renamed modules) and Trainer loads it with "
        "load_state_dict(strict=False), leaving MoE experts fresh (Transformers #48805)")

RESUME_RECORDS: tuple[PatchRecord, ...] = (
    PatchRecord(name="Trainer._load_from_checkpoint (Hub-layout checkpoints converted back)", target=_LOAD,
                versions=">=5.0", probe=_probe(("self", "resume_from_checkpoint", "model")), build=_build_load,
                epoch="5.0+", doc=_WHY, table="resume"),
    PatchRecord(name="Trainer._load_best_model (Hub-layout checkpoints converted back)", target=_BEST,
                versions=">=5.0", probe=_probe(("self",)), build=_build_best, epoch="5.0+", doc=_WHY,
                table="resume"),
)


#: How a handle of these records names them. The other patches take the conversion as a companion
#: with ``apply_records(RESUME_RECORDS, strict=False, what=RESUME_WHAT)``: the registry, then these
#: records' builders, with no detour back through this module's entry point.
RESUME_WHAT = "checkpoint resume conversion"


def enable_resume_conversion(*, strict: bool = True) -> PatchHandle:
    """Make ``Trainer``'s ``resume_from_checkpoint`` and ``load_best_model_at_end`` restore every
    saved weight (see the module docstring); every patch of this library turns it on with itself.

    Returns the undo handle (reference counted: Trainer's methods come back when the last handle is
    removed). On Transformers 4.x the records are skipped: checkpoints are saved in the model's own
    layout there. ``strict``: a release inside the gate whose functions have another shape raises
    :class:`~model_patches.PatchError` (``False``: a warning, and Trainer's own loading).
    """
    return apply_records(RESUME_RECORDS, strict=strict, what=RESUME_WHAT)


def resume_conversion_status() -> StatusTable:
    """One row per record: applied / available / skipped / failed, and why."""
    return record_status(RESUME_RECORDS)

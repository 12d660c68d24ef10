"""``Trainer`` under Accelerate's ``ParallelismConfig(cp_size=N)``: packed documents kept apart.

Stock, ``Trainer._prepare_context_parallel_inputs`` hands the batch to torch's ring attention
(``accelerator.maybe_context_parallel``), and Accelerate's hooks replace every attention mask with
``is_causal=True``: packed documents attend to each other, silently. With the packing patch on, the
record here replaces that method. Each training and evaluation step then

- shards the packed batch with :func:`~.enable.shard_batch` (every document cut head-tail over the
  ``cp`` mesh dimension, labels shifted over the whole row first), and
- runs the model's forward and backward with :func:`~.enable.enable_context_parallel` on for the
  step (keys and values gathered, the document mask applied to global positions).

The loss is Trainer's own: ``num_items_in_batch`` counts every label of the step once (Transformers
divides its all-process count by the CP size since 5.19), ``compute_loss`` multiplies by the
process count, and FSDP2 averages the gradients over its ``dp_shard_cp`` mesh: the gradients equal
one process's on the same batches, and so do the logged training and evaluation losses. Before
5.19 each label was counted once per CP process, so the record for those releases refuses context
parallelism with the upgrade to make. Settings whose loss would read a shard as a whole row
(``label_smoothing_factor``, ``compute_loss_func``, ``compute_metrics`` on logits) are refused
with the setting to change.

Under DeepSpeed's Ulysses (``sp_size``) with packed rows, a step is refused unless the model runs
flash attention (DeepSpeed drops the mask after its all-to-all; its flash path reads the gathered
``position_ids``), with the settings to change.

Accelerate also hooks every ``self_attn`` module to drop its attention mask (``is_causal=True``)
when it prepares a model for context parallelism; with packing on, a record on Accelerate leaves
those hooks out. A forward that is not sharded (TRL's ``SFTTrainer.prediction_step`` does not call
the method above) then runs the whole row on each process with the packing patch's document mask,
correct at the cost of the shard's saving; a sharded one reads its own document ids.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ..registry import PatchRecord, StatusRow, StatusTable, is_applied, package_version, record_status
from ..targets import parameters_probe
from .enable import enable_context_parallel, shard_batch

__all__ = ["ACCELERATE_HOOKS_RECORD", "CONTEXT_PARALLEL_TRAINER_RECORDS", "accelerate_version",
           "context_parallel_trainer_status", "trainer_inputs"]

logger = logging.getLogger(__name__)

_TARGET = "transformers.trainer:Trainer._prepare_context_parallel_inputs"
_HOOKS = "accelerate.accelerator:_attach_context_parallel_hooks"
#: Newest Accelerate release the hooks record was tested against.
NEWEST_TESTED_ACCELERATE = "1.16.0"

#: Keys :func:`~.enable.shard_batch` reads; the attention mask is consumed as document ids.
_SHARDED = frozenset({"input_ids", "labels", "shift_labels", "position_ids", "attention_mask"})
#: Flash-attention varlen arguments of padding-free collators: derived from the whole row's
#: documents, which the context-parallel attention reads from its own document ids instead.
_DROPPED = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})


def trainer_inputs(inputs: dict[str, Any], world: int, rank: int) -> dict[str, Any]:
    """Process ``rank``'s share of one Trainer batch: the sequence keys sharded by
    :func:`~.enable.shard_batch`, flash-attention varlen keys dropped, everything else passed on.
    The batch's own ``num_items_in_batch`` is left to Trainer, which passes its step-wide count.

    Raises:
        ValueError: another ``[B, T]`` tensor (``token_type_ids``, ``inputs_embeds``, ...), which
            would reach the model whole while its tokens are sharded.
    """
    ids = inputs["input_ids"]
    for key, value in inputs.items():
        if key in _SHARDED or key in _DROPPED or not isinstance(value, torch.Tensor):
            continue
        if value.dim() >= 2 and tuple(value.shape[:2]) == tuple(ids.shape):
            raise ValueError(
                f"context parallelism with packing: the batch's {key!r} {tuple(value.shape)} is per token, and only "
                f"{sorted(_SHARDED)} are sharded over the context-parallel processes; leave {key!r} out of the "
                "collator's batches or train without cp_size")
    local, _ = shard_batch(inputs, world, rank)
    local.pop("num_items_in_batch", None)
    rest = {k: v for k, v in inputs.items() if k not in _SHARDED and k not in _DROPPED}
    return {**rest, **local}


def _refusal(trainer: Any, model: torch.nn.Module) -> Optional[str]:
    """The Trainer setting that would make the sharded loss wrong, with its fix, or None."""
    args = trainer.args
    if getattr(trainer.accelerator.parallelism_config, "cp_backend", "torch") != "torch":
        return f"cp_backend={trainer.accelerator.parallelism_config.cp_backend!r}: set cp_backend='torch'"
    if not args.average_tokens_across_devices:
        return ("average_tokens_across_devices=False counts labels per process: set "
                "TrainingArguments(average_tokens_across_devices=True)")
    if trainer.label_smoother is not None:
        return ("label_smoothing_factor shifts the labels of each process's shard again: set "
                "label_smoothing_factor=0")
    if trainer.compute_loss_func is not None:
        return ("compute_loss_func gets this process's token shard with the labels already shifted: leave "
                "compute_loss_func unset (the model's loss, or enable_chunked_loss, reads shift_labels)")
    if not trainer.model_accepts_loss_kwargs:
        return (f"{type(model).__name__}.forward takes no num_items_in_batch, so its loss would be a per-process "
                "mean: use a model whose forward accepts **kwargs (every Transformers causal LM does)")
    if not model.training and trainer.compute_metrics is not None and not args.prediction_loss_only:
        return ("compute_metrics would get this process's logits against the whole row's labels: set "
                "prediction_loss_only=True")
    return None


@contextlib.contextmanager
def _sharded_step(model: torch.nn.Module, group: dist.ProcessGroup) -> Iterator[None]:
    """Context-parallel attention on ``model`` for one step (Trainer enters it around the forward and
    the backward, so activation-checkpoint recomputation runs it too)."""
    handle = enable_context_parallel(model, group)
    try:
        yield
    finally:
        handle.remove()


def _packed(inputs: dict[str, Any], rank: int) -> bool:
    """Whether sequence-parallel process ``rank``'s shard (``[B, L]``, the ``rank``-th contiguous
    piece of each row) comes from packed rows: its ``position_ids`` are not the row's own positions
    ``rank * L ...``, or its attention mask holds document ids."""
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel() and int(mask.max()) > 1:
        return True
    positions = inputs.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return False
    width = positions.shape[1]
    own = torch.arange(rank * width, (rank + 1) * width, device=positions.device)
    return not bool((positions == own).all())


def _ulysses_refusal(trainer: Any, model: torch.nn.Module, inputs: dict[str, Any]) -> Optional[str]:
    """Under DeepSpeed's Ulysses (``sp_size``), why packed rows would leak, or None. DeepSpeed drops
    the attention mask after its all-to-all: sdpa then attends causally across the whole row and its
    flex path rebuilds a causal block mask; its flash-attention path keeps documents apart from the
    gathered ``position_ids``. Decided over the whole sequence-parallel group, so that every
    process raises together."""
    config = trainer.accelerator.parallelism_config
    implementation = str(getattr(getattr(trainer.accelerator.unwrap_model(model), "config", None),
                                 "_attn_implementation", ""))
    if not (config.sp_enabled and config.sp_backend == "deepspeed") or "flash" in implementation:
        return None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    group = mpu.get_sequence_parallel_group()
    packed = torch.tensor(int(_packed(inputs, dist.get_rank(group))), device=inputs["input_ids"].device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    if not int(packed):
        return None
    return (f"DeepSpeed's Ulysses sequence parallelism (sp_size={config.sp_size}) drops the attention mask after "
            f"its all-to-all, so packed documents would attend to each other with attn_implementation="
            f"{implementation!r}: load the model with attn_implementation='flash_attention_2' (Ulysses keeps "
            "documents apart from the gathered position_ids there), or shard the sequence with cp_size instead "
            "of sp_size (model_patches keeps packed documents apart under context parallelism)")


def _build(original: Callable) -> Callable:
    @functools.wraps(original)
    def _prepare_context_parallel_inputs(self: Any, model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
        config = getattr(self.accelerator, "parallelism_config", None)
        if is_applied(_TARGET) and config is not None and getattr(config, "sp_enabled", False):
            why = _ulysses_refusal(self, model, inputs)
            if why is not None:
                raise ValueError(f"packing: {why}")
        if not (is_applied(_TARGET) and config is not None and config.cp_enabled):
            return original(self, model, inputs)
        why = _refusal(self, model)
        if why is not None:
            raise ValueError(f"context parallelism with packing (cp_size={config.cp_size}): {why}")
        group = self.accelerator.torch_device_mesh["cp"].get_group()
        local = trainer_inputs(inputs, dist.get_world_size(group), dist.get_rank(group))
        return functools.partial(_sharded_step, self.accelerator.unwrap_model(model), group), local

    return _prepare_context_parallel_inputs


def _build_refusal(original: Callable) -> Callable:
    @functools.wraps(original)
    def _prepare_context_parallel_inputs(self: Any, model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
        config = getattr(self.accelerator, "parallelism_config", None)
        if is_applied(_TARGET) and config is not None and config.cp_enabled:
            import transformers

            raise ValueError(
                f"context parallelism with packing (cp_size={config.cp_size}) on Transformers "
                f"{transformers.__version__}: its Trainer counts each label once per context-parallel process, "
                "so the loss and gradients would be cp_size times too small, and its torch engine drops the "
                "document mask. Upgrade Transformers to >= 5.19 (pip install -U 'transformers>=5.19')")
        return original(self, model, inputs)

    return _prepare_context_parallel_inputs


def _probe(method: Any) -> Optional[str]:
    return parameters_probe(method, first=("self", "model", "inputs"))


def _build_no_hooks(original: Callable) -> Callable:
    @functools.wraps(original)
    def _attach_context_parallel_hooks(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if is_applied(_HOOKS):
            logger.info("context parallelism with packing: Accelerate's hooks that drop the attention mask are left "
                        "out of %s", type(model).__name__)
            return None
        return original(model, *args, **kwargs)

    return _attach_context_parallel_hooks


def _hooks_probe(fn: Any) -> Optional[str]:
    return parameters_probe(fn, first=("model",))


_WHY = ("Accelerate's torch context parallelism replaces every attention mask with is_causal=True, so packed "
        "documents attend to each other")

CONTEXT_PARALLEL_TRAINER_RECORDS: tuple[PatchRecord, ...] = (
    PatchRecord(name="Trainer._prepare_context_parallel_inputs (packed documents sharded, kept apart)",
                target=_TARGET, versions=">=5.19", probe=_probe, build=_build, epoch="5.19+", doc=_WHY,
                table="context parallel"),
    PatchRecord(name="Trainer._prepare_context_parallel_inputs (refused: labels counted per CP process)",
                target=_TARGET, versions=">=4.56,<5.19", probe=_probe, build=_build_refusal, epoch="4.56-5.18",
                doc=_WHY, table="context parallel"),
)

#: Accelerate's record (gated on Accelerate's version; applied with the ones above).
ACCELERATE_HOOKS_RECORD = PatchRecord(
    name="accelerate _attach_context_parallel_hooks (attention masks kept)", target=_HOOKS, versions=">=1.10",
    probe=_hooks_probe, build=_build_no_hooks, epoch="1.10+", doc=_WHY, newest_tested=NEWEST_TESTED_ACCELERATE,
    table="context parallel", package="accelerate")


def accelerate_version() -> Optional[str]:
    """The installed Accelerate's version (what :data:`ACCELERATE_HOOKS_RECORD` is gated on), or None."""
    return package_version("accelerate")


#: How a handle of these records names them. :func:`~model_patches.enable_packing` applies them (and,
#: where Accelerate is installed, :data:`ACCELERATE_HOOKS_RECORD` at Accelerate's version) with
#: ``apply_records`` as companions: the registry, then these records' builders, no detour back here.
CONTEXT_PARALLEL_TRAINER_WHAT = "context-parallel Trainer"
ACCELERATE_HOOKS_WHAT = "context-parallel Accelerate hooks"


def context_parallel_trainer_status() -> StatusTable:
    """One row per record (Trainer's, then Accelerate's): applied / available / skipped / failed, and why."""
    rows = record_status(CONTEXT_PARALLEL_TRAINER_RECORDS)
    version = accelerate_version()
    if version is None:
        return StatusTable([*rows, StatusRow(ACCELERATE_HOOKS_RECORD.name, _HOOKS, ACCELERATE_HOOKS_RECORD.versions,
                                             "skipped", "accelerate is not installed")])
    return StatusTable([*rows, *record_status((ACCELERATE_HOOKS_RECORD,), version=version)])

"""TRL's ``GRPOTrainer`` under Accelerate's engines, for the engine tests: the same function runs on
every process of a :class:`bench.harness.dist_pool.DistPool` (sharded) and in the test's own
process (the one-process reference), as in :mod:`tests.model_patches.workers.engines`.

Sampled rollouts cannot be compared: one process generates every row of a step in one call, two
processes half each, so the random draws differ even with the same seed; greedy decoding gives
every completion of a group the same tokens, hence zero advantages and zero gradients. So the
rollouts are forced: a logits processor (:class:`ForcedTokens`, handed to the model's
``generate`` as TRL calls it) leaves one token possible at every step, chosen from the row's
tokens so far and the row's place in its group only. Both runs then generate the same
completions, and the completions of a group differ (other tokens, other lengths), so rewards,
advantages, losses and gradients are not zero.

The first member of each group ends with ``<eos>`` after a few tokens and the others never do,
so the completions of every group differ in length too: where all completions of a group are as
long, TRL's default loss (``dapo``: every token weighted by its completion's advantage, which sum
to zero over a group) can be zero on policy although the gradients are not, and a logged loss of
zero compares nothing.
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any, Optional

import torch

from bench.harness.trainers import WORDS, token_rows, word_tokenizer
from tests.model_patches.workers.engines import _apply, _full_params

PROMPTS = 8
PROMPT_LENGTH = 6  # one length: no row is padded, whichever rows share a generate call
GROUP = 2  # num_generations
COMPLETION = 6  # max_completion_length
STEPS = 3
BATCH = 4  # completions per optimizer step over all processes: BATCH // GROUP prompts
LOGGED = ("loss", "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length")


class ForcedTokens:
    """A ``LogitsProcessor`` leaving one token per row and step: a hash of the row's tokens so far
    and its member index in its group (``row % group``: TRL repeats each prompt ``group`` times
    in a row and every process generates whole groups). Member 0 ends with ``<eos>`` (id 1) at a
    step chosen by its prompt; the others never do. ``prompt_length``: the prompts' length."""

    def __init__(self, group: int, prompt_length: int) -> None:
        self.group, self.prompt_length = group, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(scores, float("-inf"))
        step = input_ids.shape[1] - self.prompt_length
        for row, ids in enumerate(input_ids.tolist()):
            member = row % self.group
            end = 1 + hash(tuple(ids[:self.prompt_length])) % (COMPLETION - 2)
            token = 1 if member == 0 and step == end else 2 + hash((tuple(ids), member)) % (WORDS - 2)
            forced[row, token] = 0.0
        return forced


def force_rollouts(model: torch.nn.Module) -> None:
    """Make ``model.generate`` (as GRPOTrainer calls it) decode with :class:`ForcedTokens` added to
    the processors its generation config builds; the class's ``generate`` runs unchanged.
    (``GRPOConfig(generation_kwargs=...)`` cannot carry it: TRL builds a ``GenerationConfig`` from
    them, which refuses ``logits_processor`` as an argument of ``generate()`` only.)"""
    from transformers import LogitsProcessorList

    def generate(*args: Any, **kwargs: Any) -> Any:
        prompt_length = kwargs["input_ids"].shape[1]
        kwargs["logits_processor"] = LogitsProcessorList([ForcedTokens(GROUP, prompt_length)])
        return type(model).generate(model, *args, **kwargs)

    model.generate = generate


def _reward(completions: list[str], **_: Any) -> list[float]:
    return [float(sum(int(word[1:]) for word in c.split()) % 17) for c in completions]


def train_grpo(mesh: Any, patches: tuple[str, ...], world: int = 1, fsdp: Optional[dict] = None) -> dict[str, Any]:
    """Train the tiny Llama with ``trl.GRPOTrainer`` and ``patches`` on ``world`` processes
    (``fsdp``: the ``fsdp_config`` of Accelerate's FSDP2; None: no sharding). Returns the logged
    ``LOGGED`` values of every step, the parameters before and after, the library's loss calls
    and what wrapped the model."""
    import trl
    from datasets import Dataset

    from bench.harness import engines
    from model_patches.loss import unused_loss_watch as loss_use
    from tests.support.tiny_models import tiny_loss_model

    if not engines.enter_run(world, mesh is not None):
        return None
    model = tiny_loss_model("llama")
    initial = _full_params(model)
    prompts = [" ".join(f"t{i}" for i in row) for row in token_rows(PROMPTS, PROMPT_LENGTH, seed=5)]
    settings: dict[str, Any] = dict(
        max_steps=STEPS, per_device_train_batch_size=BATCH // world, num_generations=GROUP,
        max_completion_length=COMPLETION, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
        save_strategy="no", disable_tqdm=True, seed=0, learning_rate=1e-3, gradient_checkpointing=False,
        dataloader_num_workers=0,
    )
    if fsdp is not None:
        settings.update(fsdp=True, fsdp_config={"version": 2, **fsdp})
    calls = loss_use._REACHED[0]
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as out:
        _apply(model, patches, stack)
        force_rollouts(model)
        if fsdp is not None:
            stack.enter_context(engines.accelerate_fsdp_on_cpu())
        run = trl.GRPOTrainer(model=model, reward_funcs=[_reward], args=trl.GRPOConfig(output_dir=out, **settings),
                              train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=word_tokenizer())
        run.train()
        from torch.distributed.fsdp import FSDPModule

        return {
            "logged": [[row[k] for k in LOGGED] for row in run.state.log_history if "loss" in row],
            "initial": initial, "params": _full_params(run.model), "loss_calls": loss_use._REACHED[0] - calls,
            "fsdp": isinstance(run.model, FSDPModule), "wrapper": type(run.model_wrapped).__name__,
            "distributed_type": str(run.accelerator.distributed_type),
        }

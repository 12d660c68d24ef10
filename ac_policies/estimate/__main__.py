"""``python -m ac_policies.estimate CONFIG.json --tokens 32768 [--batch 1] [--policy non_moe]
[--loss linear] [--fsdp 8] [--context-parallel 8] [--budget 80GB] [--dtype bf16] [--device cuda]``, or
``python -m ac_policies.estimate CONFIG.json --longest --budget 80GB [--fsdp 8] ...``

Builds the Hugging Face model of ``CONFIG.json`` (a ``config.json`` path) on the meta device at
full size (sdpa attention, training mode), applies the policy and loss, and prints the memory of
one training step (AdamW) estimated on fake tensors. With ``--budget`` (a per-process size), it
also prints the table ``fit`` chooses on fake tensors for that budget, or the smallest step peak
the choices reach when none fits. With ``--longest`` (and ``--budget``) it prints instead the
longest sequence whose step fits the budget, for the model as given (``--policy``, ``--loss``) and
with the recommended plan (``long_context`` and the hidden-state loss), with what limits going
further (:func:`ac_policies.longest_context`). Transformers is imported when the command runs; the loss patches
(``model_patches``' or another package's) come through :mod:`ac_policies.seam`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
import warnings
from typing import Optional, Sequence

import torch

from ac_policies.seam import LOSS_ALIASES, apply_loss_patch, loss_patch_names

logger = logging.getLogger("ac_policies.estimate")

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ac_policies.estimate", description=__doc__.split("\n\n")[1])
    p.add_argument("config", help="path to a Hugging Face config.json")
    p.add_argument("--tokens", type=int, help="sequence length of one sample (required unless --longest)")
    p.add_argument("--longest", action="store_true",
                   help="search the longest sequence whose step fits --budget (as given, and with the recommended plan)")
    p.add_argument("--batch", type=int, default=1, help="samples per step (default 1)")
    p.add_argument("--policy", default="none", help="checkpointing preset (full, selective, non_moe, ...; default none)")
    p.add_argument("--loss", choices=[*loss_patch_names(), *LOSS_ALIASES], default="stock",
                   help="stock: the model's own logits and loss; linear: model_patches.enable_linear_cross_entropy "
                        "(hidden_state, its old name, still works); chunked: model_patches.enable_chunked_loss; or a "
                        "loss patch registered with ac_policies.seam.register_loss_patch")
    p.add_argument("--fsdp", type=int, default=1, help="FSDP2 processes the parameters are sharded over (default 1)")
    p.add_argument("--context-parallel", type=int, default=1,
                   help="processes the sequence is sharded over (model_patches.enable_context_parallel): --tokens is "
                        "the whole sequence, the step one process's share (default 1)")
    p.add_argument("--offload-params", action="store_true",
                   help="FSDP2 CPUOffloadPolicy: parameters, gradients and optimizer state in host memory")
    p.add_argument("--budget", help="per-process memory to fit the step peak in, e.g. 80GB; prints the fitted table")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="parameter dtype (default: the config's, else fp32)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda", help="allocator rounding to model (default cuda)")
    p.add_argument("--optimizer", default="adamw", help="adamw (default), adamw_fused, sgd or none")
    return p


def build(path: str, dtype: Optional[str]) -> torch.nn.Module:
    """The model of the config at ``path`` on the meta device, sdpa attention, training mode."""
    import transformers

    with open(path) as f:
        raw = json.load(f)
    if "model_type" not in raw:
        raise ValueError(f"{path} has no 'model_type': give a Hugging Face config.json")
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    config.use_cache = False
    chosen = _DTYPES[dtype] if dtype else getattr(config, "dtype", None) or torch.float32
    if isinstance(chosen, str):
        chosen = _DTYPES.get(chosen, getattr(torch, chosen, torch.float32))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=chosen, attn_implementation="sdpa")
    return model.train()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.longest and not args.budget:
        parser.error("--longest needs --budget (the memory per process to fit the step in, e.g. 80GB)")
    if not args.longest and args.tokens is None:
        parser.error("--tokens is required (or --longest with --budget)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    import ac_policies

    start = time.perf_counter()
    logger.info("building %s on the meta device", args.config)
    model = build(args.config, args.dtype)
    apply_loss_patch(model, args.loss)
    vocab = model.config.get_text_config().vocab_size
    optimizer = None if args.optimizer.lower() == "none" else args.optimizer

    def step(m: torch.nn.Module) -> torch.Tensor:  # one process's share of the sequence
        ids = torch.randint(0, vocab, (args.batch, -(-args.tokens // args.context_parallel)))
        return m(input_ids=ids, labels=ids).loss

    kwargs = dict(optimizer=optimizer, world_size=args.fsdp, device=args.device, offload_params=args.offload_params,
                  context_parallel=args.context_parallel)
    handle = None
    if args.policy.lower() != "none":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
            handle = ac_policies.apply_policy(model, args.policy)
    if args.longest:
        from ac_policies.estimate import token_step

        print(f"{args.config}: batch {args.batch}, policy {args.policy}, {args.loss} loss")
        print(ac_policies.longest_context(model, token_step(vocab, args.batch), args.budget, **kwargs))
        logger.info("done in %.1f s", time.perf_counter() - start)
        return 0
    logger.info("tracing one training step on fake tensors (policy %s, %s loss)", args.policy, args.loss)
    result = ac_policies.estimate(model, step, **kwargs)
    print(f"{args.config}: batch {args.batch} x {args.tokens} tokens, policy {args.policy}, {args.loss} loss")
    print(result)
    if args.budget:
        if handle is not None:
            handle.remove()
        _fit(model, step, args.budget, kwargs)
    logger.info("done in %.1f s", time.perf_counter() - start)
    return 0


def _fit(model: torch.nn.Module, step, budget: str, kwargs: dict) -> None:
    """The fitted table for a per-process ``budget``: ``fit`` works on the activation peak, so the
    budget it gets is ``budget`` less the bytes no policy changes (from the estimate without one)."""
    import ac_policies
    from ac_policies.estimate.result import format_bytes
    from ac_policies.fit import parse_budget

    total = parse_budget(budget, 1)
    logger.info("estimating without checkpointing for the budget")
    bare = ac_policies.estimate(model, step, **kwargs)
    # FSDP2's gathered parameters are not in `fixed`: the fitted table's own estimate shows them
    fixed = bare.params + bare.buffers + bare.grads + bare.optimizer
    left = total - fixed
    print(f"\nbudget {format_bytes(total)} per process: {format_bytes(fixed)} for parameters, gradients and optimizer "
          f"state, {format_bytes(max(left, 0))} for activations")
    if left <= 0:
        print(f"nothing fits: parameters, gradients and optimizer state alone take {format_bytes(fixed)}; "
              "shard over more processes (--fsdp)")
        return
    sharded = contextlib.nullcontext()
    if kwargs.get("context_parallel", 1) > 1:  # fit traces its candidates with the gathered keys too
        from model_patches.context_parallel import simulate_context_parallel

        sharded = simulate_context_parallel(model, kwargs["context_parallel"])
    try:
        with sharded:
            policy = ac_policies.fit(model, step, left, fake=True)
    except ValueError as exc:
        print(f"no table fits: {exc}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
            handle = ac_policies.apply_policy(model, "full")
        try:
            print(f"smallest reachable step peak (policy full): {format_bytes(ac_policies.estimate(model, step, **kwargs).peak)}")
        finally:
            handle.remove()
        return
    print(ac_policies.plan(model, policy))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
        handle = ac_policies.apply_policy(model, policy)
    try:
        print(ac_policies.estimate(model, step, **kwargs))
    finally:
        handle.remove()


if __name__ == "__main__":
    sys.exit(main())

"""The steps the ``logprobs`` section times, each variant's forward + backward, and the eager
formulas they follow (TRL's): token log-probs with entropy, and the generalized JSD of
distillation. A setup builds its inputs and returns the step (a :mod:`bench.harness.measure` variant);
``impl`` picks the variant: ``"eager"``, ``"compiled"``, ``"trl"``, ``"liger"`` or ``"ours"``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BETA = 0.5
ENTROPY_COEF = 0.01
#: Vocabulary columns per tile in TRL's trainer (``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``).
TRL_VOCAB_CHUNK = 32768


# --- the eager formulas -----------------------------------------------------------------------

def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits ``[N, V]`` (already divided by the temperature), int labels ``[N]`` ->
    ``(logp, entropy)``, fp32 ``[N]``: the label's log-probability and the entropy per token."""
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    entropy = -(F.softmax(logits, dim=-1) * logp_all).sum(-1)
    return logp, entropy


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = BETA) -> torch.Tensor:
    """fp32 student and teacher logits ``[N, V]`` (already divided by the temperature) -> fp32
    scalar: ``beta * KL(t || m) + (1 - beta) * KL(s || m)`` summed over V, mean over tokens,
    with the mixture ``m = beta * p_t + (1 - beta) * p_s``; ``0 < beta < 1``."""
    s = F.log_softmax(student_logits, dim=-1)
    t = F.log_softmax(teacher_logits, dim=-1)
    m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), dim=0)
    kl_t = F.kl_div(m, t, reduction="none", log_target=True).sum(-1)
    kl_s = F.kl_div(m, s, reduction="none", log_target=True).sum(-1)
    return (beta * kl_t + (1 - beta) * kl_s).mean()


# --- setups: build inputs, return one forward + backward ------------------------------------

def _projection(n: int, h: int, v: int, dtype: str, device: str, *, seed: int,
                grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden ``[n, h]`` and weight ``[v, h]`` in ``dtype``; logits of standard deviation ~2."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=DTYPES[dtype])
    weight = (torch.randn(v, h, generator=g) * (2.0 / h**0.5)).to(device=device, dtype=DTYPES[dtype])
    return hidden.requires_grad_(grad), weight.requires_grad_(grad)


def _step(loss_fn: Callable[[], torch.Tensor], params: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    def step() -> None:
        loss_fn().backward()
        for p in params:
            p.grad = None

    return step


def _full_path(impl: str, full: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
               params: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    """The step of ``full(*inputs)``, eager or under ``torch.compile``."""
    if impl not in ("eager", "compiled"):
        raise ValueError(f'impl must be "eager", "compiled", "trl", "liger" or "ours", got {impl!r}')
    fn = torch.compile(full) if impl == "compiled" else full
    return _step(lambda: fn(*inputs), params)


def setup_logprobs(*, n: int, h: int, v: int, dtype: str, device: str, impl: str, temperature: float = 1.0,
                   **_: Any) -> Callable[[], None]:
    """Policy-gradient step on token log-probs and entropy from hidden ``[n, h]`` x weight ``[v, h]``."""
    hidden, weight = _projection(n, h, v, dtype, device, seed=0, grad=True)
    g = torch.Generator(device="cpu").manual_seed(1)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    adv = torch.randn(n, generator=g).to(device)

    def policy(logp: torch.Tensor, entropy: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return -(a * logp).sum() - ENTROPY_COEF * entropy.sum()

    if impl == "trl":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        def trl_loss() -> torch.Tensor:
            logp, entropy, *_ = ChunkedLogProbFunction.apply(
                hidden, weight, None, labels, temperature, TRL_VOCAB_CHUNK, None, 1.0, ("entropy",))
            return policy(logp, entropy, adv)

        return _step(trl_loss, (hidden, weight))
    if impl == "ours":
        import functional_ce

        return _step(lambda: policy(*functional_ce.linear_token_logprobs(
            hidden, weight, labels, temperature=temperature, return_entropy=True), adv), (hidden, weight))

    def full(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return policy(*logprobs_and_entropy(F.linear(x, w).float() / temperature, y), a)

    return _full_path(impl, full, (hidden, weight, labels, adv), (hidden, weight))


def setup_distill_hidden(*, n: int, h: int, v: int, dtype: str, device: str, impl: str,
                         temperature: float = 1.0, **_: Any) -> Callable[[], None]:
    """Generalized JSD from student ``[n, h] x [v, h]`` (trained) and teacher ``[n, h] x [v, h]`` (frozen)."""
    s_hidden, s_weight = _projection(n, h, v, dtype, device, seed=0, grad=True)
    t_hidden, t_weight = _projection(n, h, v, dtype, device, seed=2, grad=False)
    params = (s_hidden, s_weight)
    if impl == "trl":
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        return _step(lambda: ChunkedDivergenceFunction.apply(
            s_hidden, s_weight, None, t_hidden, t_weight, None, BETA, temperature)[0].mean(), params)
    if impl == "ours":
        import functional_ce

        return _step(lambda: functional_ce.linear_distillation_loss(
            s_hidden, s_weight, t_hidden, t_weight, beta=BETA, temperature=temperature), params)
    if impl == "liger":
        from liger_kernel.transformers import LigerFusedLinearJSD

        jsd = LigerFusedLinearJSD(jsd_beta=BETA, temperature=temperature)  # mean over tokens, as the others
        return _step(lambda: jsd(s_hidden, s_weight, t_hidden, t_weight), params)

    def full(sh: torch.Tensor, sw: torch.Tensor, th: torch.Tensor, tw: torch.Tensor) -> torch.Tensor:
        return generalized_jsd(F.linear(sh, sw).float() / temperature, F.linear(th, tw).float() / temperature)

    return _full_path(impl, full, (s_hidden, s_weight, t_hidden, t_weight), params)


def setup_distill_logits(*, n: int, v: int, dtype: str, device: str, impl: str, temperature: float = 1.0,
                         **_: Any) -> Callable[[], None]:
    """Generalized JSD from student logits ``[n, v]`` (trained) and teacher logits ``[n, v]``."""
    g = torch.Generator(device="cpu").manual_seed(0)
    student = (torch.randn(n, v, generator=g) * 2).to(device=device, dtype=DTYPES[dtype]).requires_grad_()
    teacher = (torch.randn(n, v, generator=g) * 2).to(device=device, dtype=DTYPES[dtype])
    if impl == "ours":
        import functional_ce

        return _step(lambda: functional_ce.distillation_loss(student, teacher, beta=BETA, temperature=temperature),
                     (student,))

    def full(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return generalized_jsd(s.float() / temperature, t.float() / temperature)

    return _full_path(impl, full, (student, teacher), (student,))

"""The causal-LM loss path on functional_ce: with logits (chunked, no fp32 copy) or without.

- :mod:`.chunked_loss`: ``enable_chunked_loss`` routes Transformers' ``ForCausalLMLoss``.
- :mod:`.linear_cross_entropy`: ``causal_lm_loss`` and ``enable_linear_cross_entropy`` (no logits);
  :mod:`.forward_keywords`: the keywords its patched forward takes or refuses.
- :mod:`.token_losses`: ``causal_lm_token_logprobs`` and ``causal_lm_distillation_loss``.
- :mod:`.trl_heads`: ``enable_trl_heads`` routes TRL's fused LM heads and chunked divergence.
- :mod:`.unused_loss_watch`: a training call with labels that never reached the library's loss.
- :mod:`.per_model_state`: the model a patch's refusal of TRL's kernels concerns (released when
  that model is collected), and which mode TRL's routed heads are in.
"""

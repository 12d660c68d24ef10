"""Activation checkpointing expressed as declarative predicate tables over module names.

```python
import ac_policies
print(ac_policies.plan(model, "non_moe"))            # what would happen, as a table
handle = ac_policies.apply_policy(model, "non_moe")  # do it; handle.remove() undoes it
table = [ac_policies.Rule(match="model.layers.*", when="moe", action="none"),
         {"match": "*", "when": "attention", "action": "checkpoint"}]
ac_policies.apply_policy(model, table)
ac_policies.apply_policy(model, "op_sac")            # torchtitan's op-level SAC, as a table
ac_policies.apply_policy(model, [{"when": "decoder_block", "action": "selective",
                                  "ops": ["mm", "topk"], "recompute_every": {"k": 2, "ops": ["mm"]},
                                  "save_matmuls_of": ["*.mlp.gate"]}])
```

``ac_policies.fit(model, step, "8GB")`` (or ``0.5``: half the peak without checkpointing)
returns the table with the least recompute whose measured step peak fits the budget.

``ac_policies.estimate(model, step)`` answers before anything runs: one training step (forward,
backward, optimizer step) on fake tensors, for a model built on the meta device at full size, with
its policy and loss patches; it returns a :class:`MemoryEstimate` (bytes of parameters, gradients,
optimizer state, activations and the step peak, with the phase and module of the peak) that
prints as a table. ``python -m ac_policies.estimate CONFIG.json --tokens 32768 ...`` does it for
a Hugging Face config, and ``fit(..., fake=True)`` searches on fake tensors the same way.
``ac_policies.longest_context(model, make_step, "80GB")`` (``--longest``) finds the longest
sequence whose step fits, as the model is and with the recommended plan (``long_context`` and the
hidden-state loss).

Regions are entered only in training mode with gradients on; Hugging Face's own gradient
checkpointing on top of a policy is refused; ``ac_policies.measure.step_bytes`` reports the
step peak next to the bytes kept after forward.
"""

from .apply import PolicyHandle, apply_policy, policy_of
from .estimate import LongestContext, MemoryEstimate, estimate, longest_context
from .fit import FitEstimate, fit
from .plan import ACPolicyWarning, Plan, PlanRow, plan
from .predicates import Predicate, all_of, any_of, inside, layers, not_, predicate, register_predicate
from .presets import PRESETS, resolve_policy
from .rules import ACTIONS, Rule
from .selective import DEFAULT_SAVE_OPS
from .table import Policy

__all__ = [
    "ACTIONS",
    "ACPolicyWarning",
    "DEFAULT_SAVE_OPS",
    "FitEstimate",
    "LongestContext",
    "MemoryEstimate",
    "PRESETS",
    "Plan",
    "PlanRow",
    "Policy",
    "PolicyHandle",
    "Predicate",
    "Rule",
    "all_of",
    "any_of",
    "apply_policy",
    "estimate",
    "fit",
    "inside",
    "layers",
    "longest_context",
    "not_",
    "plan",
    "policy_of",
    "predicate",
    "register_predicate",
    "resolve_policy",
]

"""The learner's algorithms: small pure functions over tensors, chosen by name through registries.

Nothing here knows about models, processes or torch.distributed: inputs are log-probs, rewards, values
and masks, shaped `(B, T)` for per-token quantities (right-padded, `mask` marks the trainable tokens),
`(G, n)` for grouped per-response quantities and `(B,)` for per-response ones.
"""

from rlfabric.learner.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    broadcast_to_tokens,
    discounted_returns,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    rloo_advantages,
)
from rlfabric.learner.algorithms.aggregation import AGGREGATIONS, Aggregation, aggregate
from rlfabric.learner.algorithms.entropy import entropy_bonus, entropy_from_logits
from rlfabric.learner.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    make_kl_controller,
)
from rlfabric.learner.algorithms.policy_loss import PolicyLossConfig, policy_loss, rollout_mismatch
from rlfabric.learner.algorithms.preference import PREFERENCE_LOSSES, dpo_loss, ipo_loss
from rlfabric.learner.algorithms.shaping import is_truncated, mask_truncated, overlong_penalty
from rlfabric.learner.algorithms.utils import masked_mean, masked_sum, masked_var, masked_whiten
from rlfabric.learner.algorithms.value_loss import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "PREFERENCE_LOSSES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "Aggregation",
    "FixedKLController",
    "PolicyLossConfig",
    "aggregate",
    "apply_kl_penalty",
    "broadcast_to_tokens",
    "discounted_returns",
    "dpo_loss",
    "dr_grpo_advantages",
    "entropy_bonus",
    "entropy_from_logits",
    "gae",
    "grpo_advantages",
    "ipo_loss",
    "is_truncated",
    "make_kl_controller",
    "mask_truncated",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "rloo_advantages",
    "rollout_mismatch",
    "value_loss",
]

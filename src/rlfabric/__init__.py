"""rlfabric: disaggregated RL post-training for language models.

Each service is a subpackage (`rlfabric.rollout`, `rlfabric.reward`, `rlfabric.learner`,
`rlfabric.coordinator`); what the processes agree on is `rlfabric.contracts` (with the generated stubs in
`rlfabric.v1`); how every service runs is `rlfabric.runtime`; published weights are `rlfabric.weights`;
`rlfabric up` is `rlfabric.local`. docs/architecture.md draws the tree.
"""

__version__ = "0.1.0"

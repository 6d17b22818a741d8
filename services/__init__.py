"""rlfabric: disaggregated RL post-training for language models.

The import package is the `services/` folder: each service is a subpackage (`rlfabric.rollout`,
`rlfabric.reward`, `rlfabric.learner`, `rlfabric.coordinator`), code they share is `rlfabric.common`, and
`rlfabric.v1` holds the stubs generated from `proto/rlfabric/v1/`.
"""

__version__ = "0.1.0"

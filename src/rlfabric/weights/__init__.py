"""Published policy weights, written by the learner and read by the rollout replicas: versions on storage
(`versions`), the store's backends (`store`), safetensors shards (`shards`) and the in-place broadcast
(`broadcast`).
"""

"""Preference data: building versioned (prompt, chosen, rejected) datasets with AI feedback.

`rlfabric prefs build PIPELINE_FILE` runs the stages a pipeline file declares (sources, judges, Constitutional
AI, hygiene) and writes an immutable, content-addressed dataset version; `prefs show|diff|list` read the
store. The shared value types live in `types`; model-backed pieces (generators, the LLM pairwise judge,
critique-revise chains) never import the pipeline, and the pipeline reaches them through `types`' protocols.
"""

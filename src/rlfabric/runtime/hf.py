"""One Hugging Face library call at a time in a process that calls them from several threads.

`datasets` looks at `transformers` whenever that is in `sys.modules` (its fingerprinting handles tokenizers
specially), and both import their submodules lazily. While one thread is still importing `transformers`
(to load a tokenizer), another thread reading a dataset met the half-initialised module and failed with
`AttributeError: module 'transformers' has no attribute 'PreTrainedTokenizerBase'`: a coordinator resuming
two runs read the first run's dataset while its check of the second run's model loaded a tokenizer, and
the first run failed with "not readable as JSON rows". Dataset reads and model or tokenizer loads that may
run beside each other therefore hold `HF_LOCK` (re-entrant: a check that reads a dataset holds it too).
"""

from __future__ import annotations

import threading

HF_LOCK = threading.RLock()

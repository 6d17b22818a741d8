"""A batch-normalised reward model through the reward engine's real worker pool (two worker processes):
the call is scored in one piece, so the rewards are standardised over the whole call, not per chunk."""

from __future__ import annotations

import math
import os

import pytest

from rlfabric.reward.scorers import ScoreInput
from rlfabric.reward.scorers.reward_model import standardize_batch
from rlfabric.reward.service import RewardEngine, ScorerSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
WORDS = ["a", "b", "c", "d", "e", "f"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("rm_whole_batch")
    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]"
    )
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, num_labels=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


async def test_batch_normalisation_spans_the_whole_call(model_dir: str) -> None:
    engine = RewardEngine(workers=2, item_timeout_s=60, inline=[])
    await engine.start()
    try:
        items = [ScoreInput(str(i), "a b", f" {WORDS[i % 6]} {WORDS[(i * 5) % 6]}") for i in range(8)]
        spec = ScorerSpec("reward_model", {"path": model_dir, "normalization": "batch"})
        batch = await engine.score(spec, items, timeout_s=120)
    finally:
        await engine.close()
    assert [r.status for r in batch.results] == ["ok"] * 8
    raw = [r.components["raw"] for r in batch.results]
    rewards = [r.reward for r in batch.results]
    assert rewards == pytest.approx(standardize_batch(raw), abs=1e-4)  # one call, not two chunks of 4
    mean = sum(rewards) / 8
    assert mean == pytest.approx(0.0, abs=1e-6)
    assert math.sqrt(sum((r - mean) ** 2 for r in rewards) / 7) == pytest.approx(1.0, abs=1e-4)

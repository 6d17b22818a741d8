"""reward_model ensembles and normalisation: the arithmetic against hand-computed values, then real tiny
sequence-classification models built here (two BERT classifiers and a Qwen2 one, random weights, a
word-level tokenizer): each member's raw score is its logit, and mean / min / mean - k*std and the batch
normalisation combine them as computed by hand."""

import math
import os

import pytest

from rlfabric.reward.scorers import InvalidScorerSpec, build_scorer, run_scorer
from rlfabric.reward.scorers.reward_model import (
    Normalizer,
    combine,
    ensemble_results,
    member_std,
    standardize_batch,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
WORDS = ["the", "answer", "is", "four", "five", "what", "two", "plus", "?", "good", "bad"]


# --- arithmetic ----------------------------------------------------------------------------------------


def test_combine_mean_min_and_mean_minus_std_by_hand() -> None:
    values = [1.0, 2.0, 6.0]  # mean 3, population variance (4 + 1 + 9) / 3 = 14/3
    assert combine(values, "mean", 1.0) == 3.0
    assert combine(values, "min", 1.0) == 1.0
    assert member_std(values) == pytest.approx(math.sqrt(14 / 3))
    assert combine(values, "mean_minus_std", 0.5) == pytest.approx(3.0 - 0.5 * math.sqrt(14 / 3))
    assert combine(values, "mean_minus_std", 0.0) == 3.0
    assert combine([2.5], "mean_minus_std", 1.0) == 2.5  # one member: no spread


def test_batch_standardisation_and_its_small_batches() -> None:
    assert standardize_batch([1.0, 2.0, 3.0]) == pytest.approx([-1.0, 0.0, 1.0])  # sample std 1
    assert standardize_batch([2.0, 4.0]) == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])
    assert standardize_batch([7.0]) == [0.0]  # one item: std undefined, taken as 1
    assert standardize_batch([3.0, 3.0, 3.0]) == [0.0, 0.0, 0.0]  # std 0, taken as 1
    assert standardize_batch([]) == []


def test_running_normalizer_keeps_its_moments_across_calls() -> None:
    running = Normalizer("running")
    assert running([5.0]) == [0.0]  # mean 5, std taken as 1
    assert running([7.0]) == pytest.approx([(7.0 - 6.0) / math.sqrt(2)])  # moments of 5, 7
    assert Normalizer("none")([5.0, 7.0]) == [5.0, 7.0]


def test_ensemble_normalises_each_member_then_combines() -> None:
    raw = [[1.0, 3.0], [10.0, 30.0]]  # member 0, member 1; items 0, 1
    batch = [Normalizer("batch"), Normalizer("batch")]
    results = ensemble_results(raw, batch, "mean_minus_std", 2.0)
    z = 1 / math.sqrt(2)  # both members standardise to [-z, z]: they agree, std 0
    assert [r.reward for r in results] == pytest.approx([-z, z])
    assert results[0].components == pytest.approx({"member0": 1.0, "member1": 10.0, "mean": -z, "std": 0.0})
    plain = ensemble_results(raw, [Normalizer("none"), Normalizer("none")], "mean_minus_std", 2.0)
    assert [r.reward for r in plain] == pytest.approx([5.5 - 2 * 4.5, 16.5 - 2 * 13.5])
    assert plain[1].components["std"] == pytest.approx(13.5)
    worst = ensemble_results(raw, [Normalizer("none"), Normalizer("none")], "min", 1.0)
    assert [r.reward for r in worst] == [1.0, 3.0]


def test_exactly_one_of_path_and_paths(tmp_path) -> None:
    with pytest.raises(InvalidScorerSpec) as both:
        build_scorer("reward_model", {"path": str(tmp_path), "paths": [str(tmp_path)]})
    assert both.value.field == "params.path"
    with pytest.raises(InvalidScorerSpec) as neither:
        build_scorer("reward_model", {})
    assert neither.value.field == "params.path"
    with pytest.raises(InvalidScorerSpec) as missing:
        build_scorer("reward_model", {"paths": [str(tmp_path), str(tmp_path / "nope")]})
    assert missing.value.field == "params.paths[1]"
    with pytest.raises(InvalidScorerSpec) as bad:
        build_scorer("reward_model", {"paths": [str(tmp_path)], "ensemble": "median"})
    assert bad.value.field == "params.ensemble"
    with pytest.raises(InvalidScorerSpec):
        build_scorer("reward_model", {"paths": [str(tmp_path)], "ensemble_k": -1.0})


def test_batch_normalisation_asks_for_the_whole_call(tmp_path) -> None:
    batch = build_scorer("reward_model", {"path": str(tmp_path), "normalization": "batch"})
    running = build_scorer("reward_model", {"path": str(tmp_path), "normalization": "running"})
    assert batch.whole_batch and not running.whole_batch
    part = {
        "alias": "rm",
        "scorer": "reward_model",
        "params": {"path": str(tmp_path), "normalization": "batch"},
    }
    composite = build_scorer("composite", {"parts": [part]})
    assert composite.whole_batch
    assert not build_scorer("composite", {"parts": [{"alias": "x", "scorer": "exact_match"}]}).whole_batch


# --- real models --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    """Three local reward models of two architectures: BERT with a word-level tokenizer (seeds 0 and 1),
    and Qwen2 with the character-level ChatML tokenizer of `rlfabric make-tiny-model` (its chat template
    formats the items)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from rlfabric.tools.tiny_model import TinyModelSpec, build_tokenizer, model_config

    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    dirs = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"rm_bert_{seed}")
        core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
        )
        config = transformers.BertConfig(
            vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=64, num_labels=1, pad_token_id=0,
        )  # fmt: skip
        torch.manual_seed(seed)
        transformers.BertForSequenceClassification(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs.append(str(path))
    path = tmp_path_factory.mktemp("rm_qwen2")
    config = model_config(TinyModelSpec(layers=1, hidden=32, heads=1, max_position=256))
    config.num_labels = 1
    torch.manual_seed(2)
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(path)
    build_tokenizer(max_length=256).save_pretrained(path)
    dirs.append(str(path))
    return dirs


PROMPT = "what is two plus two ?"
COMPLETIONS = [" the answer is four", " the answer is five", " good good good", " bad"]


def scored_items(item):
    return [item(c, prompt=PROMPT) for c in COMPLETIONS]


def logits(path):
    """Each item's logit, scored alone (no padding), its text formatted as the scorer formats it."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    for completion in COMPLETIONS:
        if tokenizer.chat_template:
            turns = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": completion}]
            text, special = tokenizer.apply_chat_template(turns, tokenize=False), False
        else:
            text, special = PROMPT + completion, True
        ids = tokenizer(text, add_special_tokens=special, return_tensors="pt")
        with torch.no_grad():
            out.append(float(model(**ids).logits[0, 0]))
    return out


def test_ensemble_of_real_models_by_hand(members, item) -> None:
    raw = [logits(path) for path in members]  # raw[m][i], each text alone (no padding)
    for how, k in (("mean", 1.0), ("min", 1.0), ("mean_minus_std", 0.5)):
        params = {"paths": members, "ensemble": how, "ensemble_k": k, "batch_size": 3}  # padded batches
        results = run_scorer(build_scorer("reward_model", params), scored_items(item))
        assert [r.status for r in results] == ["ok"] * 4
        for i, result in enumerate(results):
            scores = [raw[m][i] for m in range(3)]
            mean = sum(scores) / 3
            std = math.sqrt(sum((s - mean) ** 2 for s in scores) / 3)
            expected = {"mean": mean, "min": min(scores), "mean_minus_std": mean - k * std}[how]
            assert result.reward == pytest.approx(expected, abs=1e-5)
            assert result.components == pytest.approx(
                {"member0": scores[0], "member1": scores[1], "member2": scores[2], "mean": mean, "std": std},
                abs=1e-5,
            )


def test_batch_normalisation_of_real_models_by_hand(members, item) -> None:
    raw = logits(members[2])
    one = build_scorer("reward_model", {"path": members[2], "normalization": "batch"})
    results = run_scorer(one, scored_items(item))
    mean = sum(raw) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / 3)
    expected = [(x - mean) / std for x in raw]  # padded batch vs one by one: std amplifies float noise
    assert [r.reward for r in results] == pytest.approx(expected, abs=1e-3)
    assert [r.components["raw"] for r in results] == pytest.approx(raw, abs=1e-5)
    assert [r.reward for r in run_scorer(one, scored_items(item)[:1])] == [0.0]  # a batch of one
    pair = build_scorer("reward_model", {"paths": members[:2], "normalization": "batch", "ensemble": "min"})
    both = [standardize_batch(logits(path)) for path in members[:2]]
    expected = [min(both[0][i], both[1][i]) for i in range(4)]
    assert [r.reward for r in run_scorer(pair, scored_items(item))] == pytest.approx(expected, abs=1e-3)

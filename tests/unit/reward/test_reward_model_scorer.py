"""reward_model: a tiny randomly initialised BERT classifier with a word-level tokenizer, built here."""

import math
import os

import pytest

from rlfabric.reward.scorers import build_scorer, run_scorer
from rlfabric.reward.scorers.reward_model import RunningMoments

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
WORDS = ["the", "answer", "is", "four", "five", "what", "two", "plus", "?", "good", "bad"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tiny_rm")
    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    )
    config = transformers.BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def items(item):
    return [
        item(" the answer is four", prompt="what is two plus two ?"),
        item(" the answer is five", prompt="what is two plus two ?"),
        item(" bad", prompt=[{"role": "user", "content": "what is two plus two ?"}]),
    ]


def reference_logits(model_dir, texts):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [float(model(**tokenizer(t, return_tensors="pt")).logits[0, 0]) for t in texts]


def test_scores_equal_the_model_logits_and_batching_does_not_matter(model_dir, item):
    scorer = build_scorer("reward_model", {"path": str(model_dir), "batch_size": 2})
    assert scorer.members[0].model is None  # loaded lazily, on first use
    results = run_scorer(scorer, items(item))
    texts = ["what is two plus two ? the answer is four", "what is two plus two ? the answer is five"]
    texts.append("user: what is two plus two ? bad")
    expected = reference_logits(model_dir, texts)
    assert [r.status for r in results] == ["ok"] * 3
    assert [r.reward for r in results] == pytest.approx(expected, abs=1e-5)
    assert [r.components["raw"] for r in results] == pytest.approx(expected, abs=1e-5)
    one_by_one = build_scorer("reward_model", {"path": str(model_dir), "batch_size": 1})
    assert [r.reward for r in run_scorer(one_by_one, items(item))] == pytest.approx(expected, abs=1e-5)


def test_running_normalisation_standardises_with_welford_moments(model_dir, item):
    scorer = build_scorer("reward_model", {"path": str(model_dir), "normalization": "running"})
    results = run_scorer(scorer, items(item))
    raw = [r.components["raw"] for r in results]
    mean = sum(raw) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / 2)
    assert [r.reward for r in results] == pytest.approx([(x - mean) / std for x in raw], abs=1e-5)
    assert scorer.moments.count == 3


def test_running_moments():
    moments = RunningMoments()
    assert moments.standardize(3.0) == 3.0
    for x in (1.0, 2.0, 3.0, 4.0):
        moments.update(x)
    assert moments.mean == 2.5
    assert moments.std == pytest.approx(math.sqrt(5 / 3))


@pytest.mark.gpu  # deselected by default; run with `pytest -m gpu` on a CUDA machine
def test_cuda_device_matches_cpu(model_dir, item):
    cpu = run_scorer(build_scorer("reward_model", {"path": str(model_dir)}), items(item))
    gpu = run_scorer(build_scorer("reward_model", {"path": str(model_dir), "device": "cuda"}), items(item))
    assert [r.reward for r in gpu] == pytest.approx([r.reward for r in cpu], abs=1e-3)

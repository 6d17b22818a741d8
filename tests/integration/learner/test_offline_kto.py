"""The offline KTO run on the tiny model from a JSONL of labelled rows, desirable ones ("yes") three times
as many as undesirable ones ("no"), so that the policy's log-ratio to the reference on mismatched rows
turns positive and the reference point z0 leaves 0 after the first step: 2 gloo ranks (torchrun) train
like 1 (in this process), step for step, z0 included. z0 is a statistic of the whole step, summed over
the ranks, so the uneven shards (5 rows a step over 2 ranks, micro-batches of 2 rows) change nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.offline import run_offline

TORCHRUN = Path(sys.executable).with_name("torchrun")
TIMEOUT_S = 90
SERVE = """\
import sys
from rlfabric.learner.config import LearnerServiceConfig
from rlfabric.learner.offline import serve_offline
sys.exit(serve_offline(LearnerServiceConfig.model_validate_json(open(sys.argv[1]).read())))
"""


def make_config(model_dir: Path, data: Path, out: Path) -> LearnerServiceConfig:
    run = {
        "mode": "offline_preference",
        "output_dir": str(out),
        "model": {"path": str(model_dir), "max_model_len": 64},
        "dataset": {"path": str(data), "shuffle_seed": 5},
        "preference": {"loss": "kto", "beta": 0.5, "kto_undesirable_weight": 1.2},
        "optim": {"lr": 1e-2},
        "train": {"steps": 3, "groups_per_step": 5, "micro_batch_size": 2, "checkpoint_every": 3},
    }
    return LearnerServiceConfig.model_validate({"run_id": "kto", "run": run})


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "kto" / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_train_kto_like_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    labels = [i % 4 != 0 for i in range(16)]
    labelled = [{"prompt": f"is {i} a number?", "completion": "yes" if good else "no", "label": good}
             for i, good in enumerate(labels)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in labelled))
    outs = {n: tmp_path / f"world{n}" for n in (1, 2)}
    outs[2].mkdir()
    (outs[2] / "config.json").write_text(make_config(tiny_model_dir, data, outs[2]).model_dump_json())
    (outs[2] / "serve.py").write_text(SERVE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [str(TORCHRUN), "--standalone", "--nnodes", "1", "--nproc_per_node", "2"]
    cmd += [str(outs[2] / "serve.py"), str(outs[2] / "config.json")]
    with (outs[2] / "serve.log").open("wb") as log:
        two = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run_offline(make_config(tiny_model_dir, data, outs[1]), torch.device("cpu")) == 3
    finally:
        torch.set_num_threads(threads)
        try:
            rc = two.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(two.pid, signal.SIGKILL)
            two.wait()
            raise
    assert rc == 0, (outs[2] / "serve.log").read_text()[-4000:]
    one, other = rows(outs[1]), rows(outs[2])
    assert [r["step"] for r in one] == [1, 2, 3]
    assert one[0]["kl"] == 0.0 and one[-1]["kl"] > 0  # the policy moved away from the reference
    assert all(r["rows"] == 5 for r in one)
    for a, b in zip(one, other, strict=True):
        assert a["pair_ids"] == b["pair_ids"]
        for name in ("loss", "kl", "rewards_chosen", "rewards_rejected", "grad_norm"):
            assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-5), (a["step"], name)

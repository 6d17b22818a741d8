"""`rlfabric up`'s per-run credentials: the file is created 0600 and holds six distinct random tokens, each
service gets only its own tokens under the agreed environment names, a file written before a token existed
gains it (saved, so the next resume keeps it), and a file others can read is refused."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from rlfabric.local.credentials import Credentials, CredentialsError, for_run


def test_the_file_is_owner_only_and_holds_distinct_tokens(tmp_path: Path) -> None:
    credentials = for_run(tmp_path, resume=False)
    path = tmp_path / "credentials.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = json.loads(path.read_text())
    assert data == {"api": credentials.api, "reward": credentials.reward, "weights": credentials.weights,
                    "learner": credentials.learner, "environment": credentials.environment,
                    "rollout": credentials.rollout}  # fmt: skip
    assert len(set(data.values())) == 6 and all(len(token) >= 40 for token in data.values())
    assert for_run(tmp_path, resume=True) == credentials  # --resume keeps them
    assert for_run(tmp_path, resume=False) != credentials


@pytest.mark.parametrize("later", ["environment", "rollout"])
def test_a_file_from_before_a_token_existed_gains_it_and_keeps_it(tmp_path: Path, later: str) -> None:
    credentials = for_run(tmp_path, resume=False)
    path = tmp_path / "credentials.json"
    data = json.loads(path.read_text())
    del data[later]
    path.write_text(json.dumps(data))
    resumed = for_run(tmp_path, resume=True)
    assert resumed.api == credentials.api and len(getattr(resumed, later)) >= 40
    assert getattr(resumed, later) != getattr(credentials, later)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert for_run(tmp_path, resume=True) == resumed  # saved: the next resume hands out the same token


def test_each_service_gets_its_own_tokens_under_the_agreed_names(tmp_path: Path) -> None:
    c = Credentials.generate()
    assert c.env("reward") == {"RLFABRIC_REWARD__TOKEN": c.reward}
    assert c.env("environment") == {"RLFABRIC_ENVIRONMENT__TOKEN": c.environment}
    assert c.env("coordinator") == {
        "RLFABRIC_COORDINATOR__API__TOKEN": c.api,
        "RLFABRIC_COORDINATOR__REWARD_TOKEN": c.reward,
        "RLFABRIC_COORDINATOR__LEARNER_TOKEN": c.learner,
        "RLFABRIC_COORDINATOR__ROLLOUT_TOKEN": c.rollout,
    }
    assert c.env("rollout") == {
        "RLFABRIC_ROLLOUT__LEARNER_TOKEN": c.weights,
        "RLFABRIC_ROLLOUT__CLIENT_TOKEN": c.rollout,
    }
    assert c.env("learner") == {
        "RLFABRIC_LEARNER__PUBLISH_TOKEN": c.weights,
        "RLFABRIC_LEARNER__TOKEN": c.learner,
    }


def test_a_file_others_can_read_is_refused(tmp_path: Path) -> None:
    Credentials.generate().save(tmp_path)
    (tmp_path / "credentials.json").chmod(0o644)
    with pytest.raises(CredentialsError, match="chmod 600"):
        Credentials.load(tmp_path)


def test_a_missing_or_foreign_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CredentialsError, match="does not exist"):
        Credentials.load(tmp_path)
    (tmp_path / "credentials.json").write_text("{}")
    (tmp_path / "credentials.json").chmod(0o600)
    with pytest.raises(CredentialsError, match="not a credentials file"):
        Credentials.load(tmp_path)

"""The per-run credentials of `rlfabric up`: one random token per protected endpoint, generated when a run
directory is first used, kept in RUN_DIR/credentials.json (mode 0600: the owner alone reads it) and handed
to each service through its environment (`RLFABRIC_<SERVICE>__KEY`), never on a command line, where any
local user could read it in the process list.

    token     guards                                  held by (environment variable)
    api       the coordinator's REST API (/v1)         coordinator  RLFABRIC_COORDINATOR__API__TOKEN; `up`
    reward    the reward service's Score               reward       RLFABRIC_REWARD__TOKEN
                                                       coordinator  RLFABRIC_COORDINATOR__REWARD_TOKEN
    weights   the replicas' UpdateWeights              rollout      RLFABRIC_ROLLOUT__LEARNER_TOKEN
                                                       learner      RLFABRIC_LEARNER__PUBLISH_TOKEN
    rollout   the replicas' Generate and GetInfo       rollout      RLFABRIC_ROLLOUT__CLIENT_TOKEN
                                                       coordinator  RLFABRIC_COORDINATOR__ROLLOUT_TOKEN
    learner   the learner's GetStatus                  learner      RLFABRIC_LEARNER__TOKEN
                                                       coordinator  RLFABRIC_COORDINATOR__LEARNER_TOKEN
    environment  the environment service (multi-turn)  environment  RLFABRIC_ENVIRONMENT__TOKEN
                                                       rollout      RLFABRIC_ROLLOUT__ENVIRONMENT__TOKEN
                                                                    (only in a multi-turn run, with the
                                                                    service's address)

`up --resume` reads the same file, so a resumed run keeps its tokens; a token the file lacks (it was
written by a version of `up` before that token existed) is made then and saved into it.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

FILE_NAME = "credentials.json"

SERVICE_ENV: dict[str, dict[str, str]] = {
    "coordinator": {
        "RLFABRIC_COORDINATOR__API__TOKEN": "api",
        "RLFABRIC_COORDINATOR__REWARD_TOKEN": "reward",
        "RLFABRIC_COORDINATOR__LEARNER_TOKEN": "learner",
        "RLFABRIC_COORDINATOR__ROLLOUT_TOKEN": "rollout",
    },
    "reward": {"RLFABRIC_REWARD__TOKEN": "reward"},
    "rollout": {"RLFABRIC_ROLLOUT__LEARNER_TOKEN": "weights", "RLFABRIC_ROLLOUT__CLIENT_TOKEN": "rollout"},
    "learner": {"RLFABRIC_LEARNER__PUBLISH_TOKEN": "weights", "RLFABRIC_LEARNER__TOKEN": "learner"},
    "environment": {"RLFABRIC_ENVIRONMENT__TOKEN": "environment"},
}
"""Per service: environment variable -> the token (a field of `Credentials`) it carries."""

FIRST_TOKENS = ("api", "reward", "weights", "learner")
"""Tokens every credentials file holds."""
LATER_TOKENS = ("environment", "rollout")
"""Tokens added after the first files were written: `load` makes those a file lacks."""


def new_token() -> str:
    return secrets.token_urlsafe(32)


class CredentialsError(RuntimeError):
    """The credentials file is missing, malformed or readable by others; the message says which."""


@dataclass(frozen=True)
class Credentials:
    """The run's tokens (see the module docstring for who holds which)."""

    api: str
    reward: str
    weights: str
    learner: str
    environment: str
    rollout: str

    @classmethod
    def generate(cls) -> Credentials:
        """Fresh tokens, 32 random bytes each (URL-safe text)."""
        return cls(**{name: new_token() for name in FIRST_TOKENS + LATER_TOKENS})

    def env(self, service: str) -> dict[str, str]:
        """The environment variables that hand `service` its tokens (KeyError for an unknown service)."""
        return {name: getattr(self, field) for name, field in SERVICE_ENV[service].items()}

    def save(self, run_dir: Path) -> Path:
        """Writes RUN_DIR/credentials.json, created with mode 0600 (never readable by others, not even
        for a moment); replaces an older file atomically."""
        path = run_dir / FILE_NAME
        partial = path.with_suffix(".tmp")
        partial.unlink(missing_ok=True)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(asdict(self), out, indent=2)
        os.replace(partial, path)
        return path

    @classmethod
    def load(cls, run_dir: Path) -> Credentials:
        """The tokens saved in RUN_DIR, with a fresh one for each of `LATER_TOKENS` the file lacks;
        CredentialsError if the file is missing, malformed, or readable or writable by group or others."""
        path = run_dir / FILE_NAME
        try:
            mode = path.stat().st_mode
            data = json.loads(path.read_text())
            first = {name: str(data[name]) for name in FIRST_TOKENS}
            credentials = cls(**first, **{name: str(data.get(name) or new_token()) for name in LATER_TOKENS})
        except FileNotFoundError as exc:
            raise CredentialsError(f"{path} does not exist") from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise CredentialsError(f"{path} is not a credentials file of `rlfabric up`") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise CredentialsError(
                f"{path} is accessible by others (mode {stat.S_IMODE(mode):o}); chmod 600 it"
            )
        return credentials


def for_run(run_dir: Path, *, resume: bool) -> Credentials:
    """The run's credentials: those saved in RUN_DIR when resuming (saved back, so that a token the file
    lacked stays the same at the next resume), else fresh ones, saved there."""
    if resume:
        credentials = Credentials.load(run_dir)
        credentials.save(run_dir)
        return credentials
    credentials = Credentials.generate()
    credentials.save(run_dir)
    return credentials

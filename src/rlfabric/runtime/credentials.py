"""Credentials at process start: a service refuses to serve without its tokens unless told `--insecure`.

Every `rlfabric serve NAME` entry calls `require_credentials` once, after logging is set up and before it
binds a port. The check lives in the process entry, not in the servicers: a servicer enforces the token
it is given (`check_bearer`), and in-process tests may build one without a token. Tokens come from the
environment (`RLFABRIC_<SERVICE>__KEY`), never from a file the run directory or a manifest would show.

Invariant: a process that returns from `require_credentials` either holds every required token or was
started with `insecure: true` and has logged a WARNING saying so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from rlfabric.runtime.config import ConfigError

log = logging.getLogger(__name__)


class MissingCredential(ConfigError):
    """A service was started without a token it requires and without `--insecure` (exit status 2)."""


@dataclass(frozen=True)
class Credential:
    """One token a service needs: where it lives in the config and whether it was given."""

    key: str
    """Dotted config key, e.g. "api.token"."""
    value: str | None
    """The configured token; None when it was not given."""

    def env_var(self, service: str) -> str:
        """The environment variable the config loader maps onto `key` for `service`."""
        return f"RLFABRIC_{service.upper()}__{self.key.upper().replace('.', '__')}"


def require_credentials(service: str, credentials: Sequence[Credential], *, insecure: bool) -> None:
    """Returns when every credential is set; else raises `MissingCredential` naming the variables.

    With `insecure` nothing is required and a WARNING is logged (even when tokens were given: what is
    set is still enforced, but the operator asked to run without the guarantee).
    """
    if insecure:
        log.warning(
            "%s serving with --insecure: calls without a credential are accepted where no token is set",
            service,
            extra={"insecure": True},
        )
        return
    missing = [c.env_var(service) for c in credentials if c.value is None]
    if missing:
        raise MissingCredential(missing_message(service, missing))


def missing_message(service: str, env_vars: Sequence[str]) -> str:
    """The one-line refusal: which variables to set, and the explicit way out."""
    names = " and ".join(env_vars)
    return (
        f"the {service} service needs a credential: set {names} "
        "(or start it with --insecure to serve without one)"
    )

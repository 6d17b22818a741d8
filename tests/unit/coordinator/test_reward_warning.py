"""The run-status warning for a failed Score call: a refusal of the run's scorer says why, an outage says
the service cannot be reached."""

from __future__ import annotations

import grpc
from grpc.aio import AioRpcError, Metadata

from rlfabric.coordinator.scoring import REWARD_REFUSAL, REWARD_WARNING, reward_warning
from rlfabric.reward.client import RewardServiceError


def rpc_error(code: grpc.StatusCode, details: str) -> RewardServiceError:
    """A failed call as the reward client raises it."""
    return RewardServiceError.from_rpc(AioRpcError(code, Metadata(), Metadata(), details=details))


def test_a_refused_scorer_names_the_services_reason() -> None:
    details = "scorer.params.function: 'x.py:f' is defined in 'os', which is not in allowed_functions"
    warning = reward_warning(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, details))
    assert warning.startswith(f"{REWARD_REFUSAL} (INVALID_ARGUMENT): {details}")
    assert reward_warning(rpc_error(grpc.StatusCode.UNAUTHENTICATED, "bad token")).startswith(REWARD_REFUSAL)


def test_an_outage_is_named_by_its_status_code_only() -> None:
    warning = reward_warning(rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused 127.0.0.1:5"))
    assert warning == f"{REWARD_WARNING} (UNAVAILABLE); groups hold their samples"

"""The learner's step gauges: each row key sets its gauge; a key a row lacks keeps the gauge's last value."""

from __future__ import annotations

from prometheus_client import REGISTRY

from rlfabric.learner.gauges import GAUGES, export_row


def value(name: str, run_id: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"run_id": run_id})


def test_weight_publish_time_is_exported_and_kept_between_publishes() -> None:
    export_row("gauges-a", {"step": 1, "publish_seconds": 2.5})
    export_row("gauges-a", {"step": 2})  # no publish at this step
    assert value("rlfabric_learner_weight_publish_duration_seconds", "gauges-a") == 2.5
    assert value("rlfabric_learner_step", "gauges-a") == 2


def test_every_gauge_follows_the_naming_rules() -> None:
    for key, gauge in GAUGES.items():
        name = gauge._name
        assert name.startswith("rlfabric_learner_") and not name.endswith("_total"), key
        assert "seconds" not in key or name.endswith("_seconds"), key

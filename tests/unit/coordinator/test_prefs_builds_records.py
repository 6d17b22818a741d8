"""Build records survive the coordinator (`coordinator.prefs_builds`): read back on start, and a build that
was queued or running then is failed, since its process died with the coordinator."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from rlfabric.coordinator.config import PrefsBuildsConfig
from rlfabric.coordinator.prefs_builds import RECORD, BuildRecord, BuildState, PrefsBuilds, summarize


def record(work: Path, build_id: str, state: BuildState, minute: int) -> None:
    at = datetime(2026, 1, 1, 0, minute, tzinfo=UTC)
    body = BuildRecord(build_id=build_id, name="p", state=state, created_at=at, updated_at=at)
    (work / build_id).mkdir(parents=True)
    (work / build_id / RECORD).write_text(body.model_dump_json())


def test_unfinished_builds_are_failed_on_start_and_finished_ones_kept(tmp_path: Path) -> None:
    record(tmp_path, "a" * 16, BuildState.SUCCEEDED, 1)
    record(tmp_path, "b" * 16, BuildState.RUNNING, 2)
    record(tmp_path, "c" * 16, BuildState.QUEUED, 3)
    builds = PrefsBuilds(PrefsBuildsConfig(work_dir=str(tmp_path)))
    assert [r.build_id for r in builds.newest()] == ["c" * 16, "b" * 16, "a" * 16]
    assert [r.state for r in builds.newest()] == ["failed", "failed", "succeeded"]
    assert builds.get("b" * 16).error == "the coordinator restarted during the build"
    reread = BuildRecord.model_validate_json((tmp_path / ("c" * 16) / RECORD).read_text())
    assert reread.state == "failed"


def test_the_summary_keeps_the_counts_not_the_judges_descriptions() -> None:
    judge = {"describe": {"kind": "scorer"}, "votes": 3, "errors": 1}
    report = {
        "rows": 3,
        "stages": {},
        "hygiene": {"dropped": {}},
        "judging": {"dropped": {}, "judges": {"j": judge}},
    }
    assert summarize(report)["judging"] == {"dropped": {}, "judges": {"j": {"votes": 3, "errors": 1}}}

"""The sandbox's uid pool across processes: a reward service's scorer workers are separate processes, and
two programs running at once as one uid would share RLIMIT_NPROC (one's fork bomb starves the other) and,
unisolated, be killed together. Real processes leasing from one lock folder, as root (a service that is
not root runs programs as its own uid and has no pool).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfabric.runtime.sandbox import SandboxError, _UidPool, probe_isolation

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="the uid pool is used only when the service is root")

LEASE = """\
import sys, time
from rlfabric.runtime.sandbox import _UidPool
with _UidPool(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]).lease() as uid:
    print(uid, time.monotonic(), flush=True)
    time.sleep(float(sys.argv[4]))
print(time.monotonic(), flush=True)
"""


def lease_in_a_process(lock_dir: Path, count: int, hold_s: float) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", LEASE, "61980", str(count), str(lock_dir), str(hold_s)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def test_processes_leasing_at_once_get_different_uids(tmp_path: Path) -> None:
    procs = [lease_in_a_process(tmp_path / "uids", 4, 1.5) for _ in range(3)]
    uids = [int(p.communicate(timeout=60)[0].split()[0]) for p in procs]
    assert sorted(uids) == sorted(set(uids)) and all(61980 <= u < 61984 for u in uids)


def test_a_process_waits_for_the_only_uid_until_its_holder_lets_go(tmp_path: Path) -> None:
    first = lease_in_a_process(tmp_path / "uids", 1, 2.0)
    assert first.stdout is not None
    taken_at = float(first.stdout.readline().split()[1])
    second = lease_in_a_process(tmp_path / "uids", 1, 0.0)
    let_go_at = float(first.communicate(timeout=60)[0])
    second_took_at = float(second.communicate(timeout=60)[0].splitlines()[0].split()[1])
    assert taken_at < let_go_at <= second_took_at


def test_a_killed_holder_frees_its_uid(tmp_path: Path) -> None:
    holder = lease_in_a_process(tmp_path / "uids", 1, 600.0)
    assert holder.stdout is not None and holder.stdout.readline()
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    start = time.monotonic()
    with _UidPool(61980, 1, str(tmp_path / "uids")).lease() as uid:
        assert uid == 61980
    assert time.monotonic() - start < 5


def test_a_lock_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "uids"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    pool = _UidPool(61980, 1, str(shared))
    with pytest.raises(SandboxError, match="no group or other access"), pool.lease():
        pass


@pytest.mark.skipif(probe_isolation().mode == "none", reason="no sandbox isolation here")
def test_programs_run_from_two_processes_run_as_different_uids(tmp_path: Path) -> None:
    """Through `run_python` itself: each process's program prints its uid while the other's still runs."""
    code = (
        "import sys, time\n"
        "from rlfabric.runtime.sandbox import SandboxLimits, run_python\n"
        f"limits = SandboxLimits(wall_s=20.0, uid_base=61980, uid_count=2, uid_lock_dir={str(tmp_path)!r})\n"
        "run = run_python('import os, time\\nprint(os.getuid())\\ntime.sleep(3)\\n', limits=limits)\n"
        "assert run.ok, run.stderr\n"
        "print(run.stdout.strip())\n"
    )
    argv = [sys.executable, "-c", code]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    uids = [int(p.communicate(timeout=120)[0]) for p in procs]
    assert sorted(uids) == [61980, 61981]  # one after the other, both would have had 61980

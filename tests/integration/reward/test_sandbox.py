"""The code_exec sandbox against real untrusted programs: correctness, limits, and containment.

Needs namespaces (root with CAP_SYS_ADMIN, or unprivileged user namespaces); where they are unavailable
the containment tests skip and only the refusal is checked (in the unit tests).
"""

import os
import socket
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from rlfabric.reward.scorers import ScoreInput, build_scorer, run_scorer
from rlfabric.runtime import sandbox
from rlfabric.runtime.sandbox import SandboxLimits, limit_exceeded, probe_isolation, run_python

ISOLATION = probe_isolation()
pytestmark = pytest.mark.skipif(ISOLATION.mode == "none", reason=f"no sandbox isolation: {ISOLATION.detail}")
# Their own uids, apart from the default pool's: other tests (other workers) may run sandboxed programs
# meanwhile, and `sandbox_pids` must see only this module's.
FAST = SandboxLimits(
    cpu_s=2, wall_s=4.0, memory_mb=256, max_processes=16, file_size_mb=1, uid_base=61900, uid_count=4
)
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
STDIN_TESTS = [
    {"input": "1 2\n", "output": "3\n"},
    {"input": "5 5\n", "output": "10\n"},
    {"input": "0 0", "output": "0"},
]


def item(completion: str, tests) -> ScoreInput:
    return ScoreInput(id="x", prompt="", completion=completion, metadata={"tests": tests})


def score(completions, tests, **params):
    scorer = build_scorer("code_exec", {"cpu_s": 2, "wall_s": 3.0, **params})
    return run_scorer(scorer, [item(c, tests) for c in completions], timeout_s=120)


def sandbox_pids(base: int = FAST.uid_base, count: int = FAST.uid_count) -> list[int]:
    """Host pids of live (not zombie) processes running as one of `FAST`'s sandbox uids."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines())
        except (OSError, ValueError):
            continue
        uid = int(fields["Uid"].split()[0])
        if base <= uid < base + count and not fields["State"].strip().startswith(("Z", "X")):
            pids.append(int(entry.name))
    return pids


def test_correct_solution_scores_one():
    [result] = score([f"Here you go:\n```python\n{ADD}```\n"], STDIN_TESTS)
    assert (result.status, result.reward) == ("ok", 1.0)
    assert result.components == {"passed": 3.0, "total": 3.0, "timed_out": 0.0}


def test_partial_solution_scores_the_pass_fraction():
    wrong_on_zero = "a, b = map(int, input().split())\nprint(a + b if a else 7)\n"
    [result] = score([wrong_on_zero], STDIN_TESTS)
    assert result.reward == pytest.approx(2 / 3)


def test_assert_tests_and_main_guard():
    code = "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(int(input()), 1))\n"
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]
    [result] = score([code], tests)
    assert result.reward == pytest.approx(2 / 3)


def test_exiting_early_does_not_pass_assert_tests():
    [result] = score(["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"], ["assert False"])[0:1]
    assert result.reward == 0.0


def test_infinite_loop_fails_its_tests_quickly():
    start = time.monotonic()
    [result] = score(["while True:\n    pass\n"], STDIN_TESTS[:2], cpu_s=1, wall_s=2.0)
    assert time.monotonic() - start < 8
    assert (result.status, result.reward) == ("ok", 0.0)
    assert result.components["timed_out"] == 2.0


def test_sleeping_program_is_killed_at_the_wall_limit():
    start = time.monotonic()
    run = run_python("import time\ntime.sleep(60)\n", limits=SandboxLimits(cpu_s=5, wall_s=1.0))
    assert run.timed_out and time.monotonic() - start < 3


def test_total_item_budget_stops_running_tests():
    start = time.monotonic()
    [result] = score(["import time\ntime.sleep(60)\n"], STDIN_TESTS, wall_s=1.0, total_wall_s=1.5)
    assert time.monotonic() - start < 5
    assert result.reward == 0.0 and result.components["timed_out"] == 2.0


def test_fork_bomb_is_contained():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    run = run_python(bomb, limits=FAST)
    assert run.timed_out and time.monotonic() - start < FAST.wall_s + 3
    assert sandbox_pids() == []


FORK_COUNTER = """\
import os, time
n = 0
try:
    while n < 100:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        n += 1
except OSError:
    pass
print(n)
"""


def test_fork_is_refused_past_the_process_limit():
    run = run_python(FORK_COUNTER, limits=FAST)
    assert run.returncode == 0 and int(run.stdout) < FAST.max_processes
    assert sandbox_pids() == []  # the sleeping children died with the program's pid namespace


def test_memory_bomb_is_contained():
    run = run_python("x = bytearray(4 * 1024**3)\n", limits=FAST)
    assert run.returncode != 0 and "MemoryError" in run.stderr
    gradual = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))\n", limits=FAST)
    assert not gradual.ok and not gradual.timed_out


def test_network_egress_is_blocked_even_to_host_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        f"for addr in [('127.0.0.1', {port}), ('10.0.0.1', 80), ('1.1.1.1', 53)]:\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=1)\n"
        "        print('connected')\n"
        "    except OSError as exc:\n"
        "        print('blocked', exc.errno)\n"
        "print(sorted(n for _, n in socket.if_nameindex()))\n"
    )
    try:
        run = run_python(code, limits=FAST)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stderr
    assert all(line.startswith("blocked") for line in lines[:3]) and lines[3] == "['lo']"


def test_parent_environment_secrets_are_not_visible(monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("RLF_TEST_SECRET", secret)
    code = (
        "import glob, os\n"
        "print(sorted(os.environ))\n"
        "hits = []\n"
        "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
        "    try:\n"
        f"        hits += [path] if b'{secret}' in open(path, 'rb').read() else []\n"
        "    except OSError:\n"
        "        pass\n"
        "print(hits, len(glob.glob('/proc/[0-9]*')))\n"
    )
    run = run_python(code, limits=FAST)
    assert run.returncode == 0, run.stderr
    env_line, hits_line = run.stdout.splitlines()
    assert env_line == "['HOME', 'LANG', 'PATH']"
    assert hits_line.startswith("[] ")  # and the program sees only its own pid namespace
    assert int(hits_line.split()[1]) <= 2


WRITER = """\
import sys
for path in %r:
    try:
        open(path, "w").write("x")
    except OSError:
        pass
open("inside.txt", "w").write("x")
"""


def test_writes_outside_the_sandbox_dir_fail_or_are_wiped(tmp_path, monkeypatch):
    name = f"rlf-escape-{uuid.uuid4().hex}"
    targets = [f"/tmp/{name}", f"/var/tmp/{name}", f"/dev/shm/{name}", f"{os.getcwd()}/{name}", f"/{name}"]
    # This run's host temp dir in a folder of its own: other test workers' sandboxes share /tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run = run_python(WRITER % targets, limits=FAST)
    assert run.returncode == 0, run.stderr
    assert [t for t in targets if os.path.exists(t)] == []
    assert list(tmp_path.glob("rlfabric-sandbox-*")) == []  # the host temp dir of the run is gone


def test_big_files_and_output_floods_are_limited():
    code = (
        "written = 0\n"
        "try:\n"
        "    with open('big.bin', 'wb') as f:\n"
        "        for _ in range(100):\n"
        "            f.write(b'x' * 2**20)\n"
        "            f.flush()\n"
        "            written += 1\n"
        "except OSError as exc:\n"
        "    print('limited', exc.errno, written)\n"
    )
    run = run_python(code, limits=FAST)
    assert run.stdout.split()[:2] == ["limited", "27"]  # EFBIG
    flood = run_python("print('x' * 50 * 2**20)\n", limits=FAST)
    assert flood.returncode != 0 and len(flood.stdout) <= FAST.file_size_mb * 2**20
    assert limit_exceeded(flood, FAST) == "file size limit (1 MB) exceeded"


def test_items_run_concurrently_with_separate_sandboxes():
    start = time.monotonic()
    sleepy = "import time\ntime.sleep(1)\n" + ADD
    scorer = build_scorer("code_exec", {"wall_s": 5.0})
    results = run_scorer(scorer, [item(sleepy, STDIN_TESTS[:1]) for _ in range(6)], max_workers=6)
    assert [r.reward for r in results] == [1.0] * 6
    assert time.monotonic() - start < 5


def test_unisolated_mode_still_applies_rlimits_and_the_uid_drop(monkeypatch):
    none = sandbox.Isolation("none", ISOLATION.python, "forced by the test")
    monkeypatch.setattr(sandbox, "probe_isolation", lambda: none)
    run = run_python("import os\nprint(os.getuid())\n", limits=FAST, allow_unisolated=True)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) != 0  # root drops to a pool uid; a non-root service is not uid 0 anyway
    start = time.monotonic()
    escape = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n"
    assert run_python(escape, limits=FAST, allow_unisolated=True).returncode == 0
    assert time.monotonic() - start < 20  # the run did not wait for its escaped child's 30 s sleep
    if os.getuid() == 0:
        assert sandbox_pids() == []  # the escaped, re-sessioned child was killed by uid
    spin = run_python(
        "while True:\n    pass\n", limits=SandboxLimits(cpu_s=1, wall_s=30.0), allow_unisolated=True
    )
    assert spin.cpu_exceeded  # the CPU limit ended it, long before the wall limit would have


def test_isolation_probe_reports_the_namespaced_mode():
    assert ISOLATION.mode == ("root" if os.getuid() == 0 else "userns")
    assert os.access(ISOLATION.python, os.X_OK)

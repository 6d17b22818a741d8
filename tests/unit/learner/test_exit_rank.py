"""`exit_rank`: a learner process that finished ends with its code, its atexit handlers run and its output
flushed, without the interpreter's teardown (where a finished gloo rank was seen aborting)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = """\
import atexit, logging, os, sys
from rlfabric.learner.dist import exit_rank

class Finalized:
    def __init__(self):
        self.fd, self.write = os.open(sys.argv[1] + ".teardown", os.O_WRONLY | os.O_CREAT), os.write

    def __del__(self):
        self.write(self.fd, b"ran")

kept = Finalized()  # collected only in the interpreter's teardown
atexit.register(lambda: open(sys.argv[1] + ".atexit", "w").write("ran"))
logging.basicConfig(filename=sys.argv[1] + ".log", level=logging.INFO)
logging.getLogger("x").info("the last log line")
sys.stdout.write("unflushed stdout")
sys.stderr.write("unflushed stderr")
exit_rank(3)
print("after exit_rank")
"""


def test_exit_rank_runs_atexit_flushes_and_skips_teardown(tmp_path: Path) -> None:
    base = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(base)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "unflushed stdout"
    assert proc.stderr.endswith("unflushed stderr")
    assert Path(f"{base}.atexit").read_text() == "ran"
    assert "the last log line" in Path(f"{base}.log").read_text()
    assert Path(f"{base}.teardown").read_text() == ""  # the interpreter's teardown never ran

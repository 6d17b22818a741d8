"""Run one untrusted Python program in a separate, resource-limited, network-less process.

`run_python(code, stdin, limits)` writes the program to a fresh host temp dir (wiped afterwards) and
starts `_sandbox_launcher.py` in a new session with a clean environment; the launcher puts the program in
fresh mount, network and pid namespaces, applies rlimits (CPU, address space, processes, file size, open
files, no core dumps), drops to an unprivileged uid and execs `python -I -S`. See the launcher's
docstring for the per-mode details.

Why each defence exists:
- network: a fresh network namespace has only a downed loopback, so every connect fails, including to
  127.0.0.1 (a different loopback from the host's).
- processes: RLIMIT_NPROC is not enforced for root, so when the service is root the program runs as a uid
  from a private pool (`uid_base`..`uid_base+uid_count-1`, one per concurrent run on the host, so one
  run's fork bomb cannot use up another's process budget; a uid is held by a lock file in `uid_lock_dir`,
  so the scorer worker processes of a reward service and an environment service's tools never share one);
  every process it starts lives in its pid namespace and is
  killed when the program (pid 1 there) ends or is killed at the wall-clock limit. (Unisolated runs as
  root instead kill every process of the run's uid afterwards.)
- files: stdout/stderr go to host files capped by RLIMIT_FSIZE; /tmp, /var/tmp and /dev/shm are private
  size-limited tmpfs mounts that vanish with the namespace; the rest of the tree is writable only where
  the unprivileged uid could write anyway.
- secrets: the environment is exactly PATH, LANG and HOME, and the private /proc shows no host process.

`probe_isolation()` (cached) finds out once whether the namespaced modes work here. Where they do not,
`run_python` refuses (`IsolationUnavailable`) unless the caller passes `allow_unisolated=True`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import os
import queue
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
IsolationMode = Literal["root", "userns", "none"]
KILL_GRACE_S = 2.0
_PROBE_CODE = "import socket; print(','.join(sorted(n for _, n in socket.if_nameindex())))"


class SandboxError(RuntimeError):
    """The sandbox could not be set up; the program did not run (a fault of this host, not the code)."""


class IsolationUnavailable(SandboxError):
    """Namespaced isolation does not work on this host and the caller did not allow running without it."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one program run. Sizes in MiB, times in seconds."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    max_processes: int = 32
    file_size_mb: int = 8
    max_open_files: int = 64
    tmpfs_mb: int = 64
    uid_base: int = 61000
    uid_count: int = 64
    uid_lock_dir: str = "/tmp/rlfabric-sandbox-uids"  # one fixed folder: TMPDIR differs between processes

    def as_launcher_limits(self) -> dict[str, int]:
        mib = 1024 * 1024
        return {
            "cpu_s": self.cpu_s,
            "memory_bytes": self.memory_mb * mib,
            "max_processes": self.max_processes,
            "file_size_bytes": self.file_size_mb * mib,
            "max_open_files": self.max_open_files,
        }


@dataclass(frozen=True)
class SandboxRun:
    """What one program run did. `returncode` is None when it was killed by a signal (`signal` set)."""

    returncode: int | None
    signal: int | None
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def cpu_exceeded(self) -> bool:
        return self.signal in (signal.SIGXCPU, signal.SIGKILL) and not self.timed_out


# What a program's last words say when an rlimit stopped it (Python raises rather than dies for these).
_STDERR_SIGNS = (
    (("MemoryError",), "memory limit ({memory_mb} MB) exceeded"),
    (("BlockingIOError", "can't start new thread"), "process limit ({max_processes}) reached"),
    (("Too many open files",), "open file limit ({max_open_files}) reached"),
    (("File too large",), "file size limit ({file_size_mb} MB) exceeded"),  # Python ignores SIGXFSZ
)


def limit_exceeded(run: SandboxRun, limits: SandboxLimits) -> str | None:
    """Which limit ended or broke `run`, as a message with the limit's value ("cpu time limit (2 s)
    exceeded"); None when no limit shows. Signals are certain; the stderr signs are what the program
    printed (it could fake them, which only mislabels its own failure)."""
    if run.timed_out:
        return f"wall time limit ({limits.wall_s:g} s) exceeded"
    if run.cpu_exceeded:
        return f"cpu time limit ({limits.cpu_s} s) exceeded"
    if run.signal == signal.SIGXFSZ:
        return f"file size limit ({limits.file_size_mb} MB) exceeded"
    tail = run.stderr[-2000:]
    for signs, message in _STDERR_SIGNS:
        if any(sign in tail for sign in signs):
            return message.format(**dataclasses.asdict(limits))
    return None


@dataclass(frozen=True)
class Isolation:
    """The result of `probe_isolation`: the mode that works here, its interpreter, or why none does."""

    mode: IsolationMode
    python: str
    detail: str


class _UidPool:
    """Hands out unprivileged uids to concurrent runs (only used when the service is root), distinct across
    every process on the host that uses the same lock folder.

    A uid is held by an exclusive `flock` on `lock_dir/<uid>`, which the kernel drops when the holder
    closes the file or dies, so a killed worker never keeps its uid. Inside a process a queue makes runs
    wait for a uid the process is not using; one that another process holds goes to the back."""

    def __init__(self, base: int, count: int, lock_dir: str) -> None:
        self.base, self.count, self.lock_dir = base, count, Path(lock_dir)
        self._free: queue.Queue[int] = queue.Queue()
        for uid in range(base, base + count):
            self._free.put(uid)

    @contextmanager
    def lease(self) -> Iterator[int]:
        self._check_lock_dir()
        tried = 0
        while True:
            uid = self._free.get()
            fd = os.open(self.lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                os.close(fd)
                self._free.put(uid)
                tried += 1
                if tried % self.count == 0:
                    time.sleep(0.05)  # every uid is in use somewhere: wait for one to be let go
        try:
            yield uid
        finally:
            os.close(fd)
            self._free.put(uid)

    def _check_lock_dir(self) -> None:
        """The folder is root's alone: a user who made it first could otherwise hold every uid's lock."""
        self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.lock_dir.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise SandboxError(
                f"sandbox uid lock folder {self.lock_dir} must be a folder owned by uid {os.getuid()} with "
                f"no group or other access (mode {stat.S_IMODE(st.st_mode):o}, owner {st.st_uid})"
            )


@functools.cache
def _uid_pool(base: int, count: int, lock_dir: str) -> _UidPool:
    return _UidPool(base, count, lock_dir)


@contextmanager
def _leased_uid(limits: SandboxLimits) -> Iterator[int]:
    if os.getuid() != 0:
        yield os.getuid()
        return
    with _uid_pool(limits.uid_base, limits.uid_count, limits.uid_lock_dir).lease() as uid:
        yield uid


def _interpreter_candidates() -> list[str]:
    found = [os.path.realpath(sys.executable)]
    for name in ("/usr/local/bin/python3", "/usr/bin/python3"):
        if os.path.exists(name) and os.path.realpath(name) not in found:
            found.append(os.path.realpath(name))
    return found


@functools.cache
def probe_isolation() -> Isolation:
    """Find the namespaced mode and an interpreter the sandbox uid can run; mode "none" if none works."""
    mode: IsolationMode = "root" if os.getuid() == 0 else "userns"
    reasons = []
    for python in _interpreter_candidates():
        try:
            run = _run({"main.py": _PROBE_CODE}, "", SandboxLimits(wall_s=20.0), mode, python)
        except SandboxError as exc:
            reasons.append(f"{python}: {exc}")
            continue
        if run.ok and run.stdout.strip() == "lo":
            return Isolation(mode, python, f"{mode} namespaces (net, pid, mount) with {python}")
        reasons.append(f"{python}: probe exit={run.returncode} out={run.stdout!r} err={run.stderr[-300:]!r}")
    return Isolation("none", os.path.realpath(sys.executable), "; ".join(reasons))


def run_python(
    code: str,
    stdin: str = "",
    limits: SandboxLimits | None = None,
    *,
    files: dict[str, str] | None = None,
    allow_unisolated: bool = False,
) -> SandboxRun:
    """Run `code` as the program `main.py` with `stdin`, next to `files` (name -> text) in its cwd.

    Raises `SandboxError` if the sandbox cannot be built (`IsolationUnavailable` if it would not isolate).
    """
    isolation = probe_isolation()
    if isolation.mode == "none" and not allow_unisolated:
        raise IsolationUnavailable(
            f"refusing to run untrusted code without isolation (no network/pid namespaces here: "
            f"{isolation.detail}); set allow_unisolated=True to run it with rlimits only"
        )
    program = {**(files or {}), "main.py": code}
    return _run(program, stdin, limits or SandboxLimits(), isolation.mode, isolation.python)


def _run(
    files: dict[str, str], stdin: str, limits: SandboxLimits, mode: IsolationMode, python: str
) -> SandboxRun:
    host_dir = Path(tempfile.mkdtemp(prefix="rlfabric-sandbox-"))
    try:
        with _leased_uid(limits) as uid:
            try:
                return _run_in(host_dir, files, stdin, limits, mode, python, uid)
            finally:
                if mode == "none" and os.getuid() == 0:
                    _kill_uid(uid, python)
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)


def _kill_uid(uid: int, python: str) -> None:
    """Without a pid namespace, kill whatever the program left running (e.g. after `setsid`): a helper
    running as the run's private uid SIGKILLs every process of that uid (kill(-1) spares only itself)."""
    code = (
        "import os\nfor _ in range(3):\n    try:\n        os.kill(-1, 9)\n    except OSError:\n        pass\n"
    )
    subprocess.run(
        [python, "-I", "-S", "-c", code],
        user=uid,
        group=uid,
        extra_groups=[],
        env={},
        check=False,
        timeout=10,
    )


def _run_in(
    host_dir: Path,
    files: dict[str, str],
    stdin: str,
    limits: SandboxLimits,
    mode: IsolationMode,
    python: str,
    uid: int,
) -> SandboxRun:
    work = host_dir / "work"
    work.mkdir()
    for name, text in files.items():
        if "/" in name or name.startswith("."):
            raise ValueError(f"sandbox file names must be plain names, got {name!r}")
        (work / name).write_text(text)
    (host_dir / "stdin").write_text(stdin)
    if mode == "none" and os.getuid() == 0:
        host_dir.chmod(0o711)  # the program must reach work/ by path; it may not list or write host_dir
        for path in (work, *work.iterdir()):
            os.chown(path, uid, uid)
    config = {
        "mode": mode,
        "uid": uid,
        "gid": uid,
        "limits": limits.as_launcher_limits(),
        "tmpfs_mb": limits.tmpfs_mb,
        "argv": [python, "-I", "-S", "main.py"],
    }
    return _launch(host_dir, work, config, limits.wall_s)


def _launch(host_dir: Path, work: Path, config: dict, wall_s: float) -> SandboxRun:
    paths = {name: host_dir / name for name in ("stdin", "stdout", "stderr", "status")}
    with (
        open(paths["stdin"], "rb") as fin,
        open(paths["stdout"], "wb") as fout,
        open(paths["stderr"], "wb") as ferr,
        open(paths["status"], "wb") as fstatus,
    ):
        config["status_fd"] = fstatus.fileno()
        argv = [os.path.realpath(sys.executable), "-I", "-S", str(LAUNCHER), json.dumps(config)]
        start = time.monotonic()
        proc = subprocess.Popen(
            argv,
            stdin=fin,
            stdout=fout,
            stderr=ferr,
            cwd=work,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            pass_fds=(fstatus.fileno(),),
            start_new_session=True,
        )
        timed_out = _wait_or_kill(proc, wall_s)
        wall = time.monotonic() - start
    return _collect(paths, timed_out, wall)


def _wait_or_kill(proc: subprocess.Popen[bytes], wall_s: float) -> bool:
    """Wait for the launcher; past `wall_s` stop the program. True if it timed out.

    On timeout the launcher gets SIGTERM and SIGKILLs the program itself (its child, which it then reaps,
    so the pid namespace is torn down and nothing is left for the host's init to reap); a launcher that
    does not exit within `KILL_GRACE_S` is SIGKILLed. Either way its whole process group is SIGKILLed
    before the launcher is reaped, so the group id cannot have been reused by an unrelated process.
    """
    timed_out = not _wait_exit(proc.pid, wall_s)
    if timed_out:
        proc.send_signal(signal.SIGTERM)
        _wait_exit(proc.pid, KILL_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return timed_out


def _wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for the child `pid` to exit, without reaping it. True if it exited."""
    pidfd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(timeout_s * 1000))
    finally:
        os.close(pidfd)


def _read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _collect(paths: dict[str, Path], timed_out: bool, wall_s: float) -> SandboxRun:
    status = _read_text(paths["status"]).splitlines()
    errors = [line[len("error ") :] for line in status if line.startswith("error ")]
    if errors or (not timed_out and "ready" not in status):
        raise SandboxError(f"sandbox setup failed: {'; '.join(errors) or _read_text(paths['stderr'])[-500:]}")
    returncode, sig = None, None
    for line in status:
        kind, _, value = line.partition(" ")
        if kind == "exit":
            returncode = int(value)
        elif kind == "signal":
            sig = int(value)
    if timed_out:
        sig = sig or signal.SIGKILL
    return SandboxRun(
        returncode, sig, _read_text(paths["stdout"]), _read_text(paths["stderr"]), timed_out, wall_s
    )

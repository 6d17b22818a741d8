"""In-sandbox launcher: builds the isolation around one untrusted Python program, then execs it.

Run by `sandbox.py` as `python -I -S _sandbox_launcher.py '<config json>'` in a fresh session, with a
clean environment, stdin/stdout/stderr already redirected to host-side files, and one extra fd
(`status_fd`) for the setup protocol. It is a separate, single-threaded process on purpose: `unshare`,
`mount`, `setuid` and `prctl` are unsafe in a `preexec_fn` of a multi-threaded service, and Python 3.11
has no `os.unshare`, so they are called through ctypes here. Standard library only (it runs with -S).

Modes (`config["mode"]`):
- "root": the service is root. unshare(mount|net|pid) directly; the program runs as the unprivileged
  `uid`/`gid` from the config, so RLIMIT_NPROC is enforced (the kernel ignores it for root).
- "userns": the service is not root. unshare(user|mount|net|pid) and map the service's uid to 65534
  inside the new user namespace; the program keeps the service's uid outside it.
- "none": no namespaces (the caller opted into `allow_unisolated`); rlimits and the uid drop only.

In the namespaced modes the launcher masks /tmp, /var/tmp and /dev/shm with private tmpfs mounts, copies
the program's files into /tmp/sandbox (its cwd and HOME), forks a child that becomes pid 1 of the new pid
namespace (so every process the program starts dies with it), mounts a fresh /proc there (host processes
and their environments are invisible), applies rlimits, drops privileges and execs the program.

On SIGTERM (the host's wall-clock limit) the launcher SIGKILLs the program and reaps it, which tears
down its pid namespace.

Status protocol on `status_fd`, one line each: "ready" just before the exec, "error <text>" if setup
failed (nothing ran), then "exit <code>" or "signal <n>" written by the launcher once the program ends.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
MASKED_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
SANDBOX_DIR = "/tmp/sandbox"

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    ret = _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(ret, f"mount {fstype or source} on {target}")


def _write_file(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _enter_namespaces(mode: str) -> None:
    """unshare the mount, network and pid namespaces (and a user namespace when not root)."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
    if mode == "userns":
        uid, gid = os.getuid(), os.getgid()
        _check(_libc.unshare(flags | CLONE_NEWUSER), "unshare(user|mount|net|pid)")
        _write_file("/proc/self/setgroups", "deny")
        _write_file("/proc/self/uid_map", f"65534 {uid} 1")
        _write_file("/proc/self/gid_map", f"65534 {gid} 1")
    else:
        _check(_libc.unshare(flags), "unshare(mount|net|pid)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)


def _read_files(directory: str) -> dict[str, bytes]:
    files = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            files[name] = f.read()
    return files


def _prepare_private_tmp(tmpfs_mb: int, uid: int, gid: int) -> str:
    """Mask the shared temp dirs with private tmpfs and recreate the program's files in /tmp/sandbox."""
    files = _read_files(os.getcwd())
    for path in MASKED_DIRS:
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmpfs_mb}m,mode=1777")
    os.mkdir(SANDBOX_DIR, 0o700)
    for name, data in files.items():
        with open(os.path.join(SANDBOX_DIR, name), "wb") as f:
            f.write(data)
        os.chown(os.path.join(SANDBOX_DIR, name), uid, gid)
    os.chown(SANDBOX_DIR, uid, gid)
    os.chdir(SANDBOX_DIR)
    return SANDBOX_DIR


def _mount_private_proc() -> None:
    """A /proc for the new pid namespace; where the kernel refuses that, hide /proc entirely."""
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    except OSError:
        _mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,mode=555")


def _apply_rlimits(limits: dict[str, int]) -> None:
    cpu = limits["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    for name, key in (
        ("RLIMIT_AS", "memory_bytes"),
        ("RLIMIT_NPROC", "max_processes"),
        ("RLIMIT_FSIZE", "file_size_bytes"),
        ("RLIMIT_NOFILE", "max_open_files"),
    ):
        value = limits[key]
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _drop_privileges(mode: str, uid: int, gid: int) -> None:
    if mode != "userns" and os.getuid() == 0:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")


def _child(config: dict, status: int, home: str) -> None:
    """Runs in the forked child (pid 1 of the new pid namespace unless mode is "none"); never returns."""
    try:
        if config["mode"] != "none":
            _mount_private_proc()
        _apply_rlimits(config["limits"])
        _drop_privileges(config["mode"], config["uid"], config["gid"])
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home}
        os.write(status, b"ready\n")
        os.execve(config["argv"][0], config["argv"], env)
    except BaseException as exc:
        os.write(status, f"error {type(exc).__name__}: {exc}\n".encode())
    os._exit(127)


def _wait_and_report(pid: int, status: int) -> int:
    _, wstatus = os.waitpid(pid, 0)
    if os.WIFSIGNALED(wstatus):
        os.write(status, f"signal {os.WTERMSIG(wstatus)}\n".encode())
        return 128 + os.WTERMSIG(wstatus)
    code = os.WEXITSTATUS(wstatus)
    os.write(status, f"exit {code}\n".encode())
    return code


def main() -> int:
    config = json.loads(sys.argv[1])
    status = config["status_fd"]
    os.set_inheritable(status, False)
    uid, gid = config["uid"], config["gid"]
    try:
        home = os.getcwd()
        if config["mode"] != "none":
            _enter_namespaces(config["mode"])
            if config["mode"] == "userns":
                uid, gid = os.getuid(), os.getgid()
            home = _prepare_private_tmp(config["tmpfs_mb"], uid, gid)
        pid = os.fork()
    except BaseException as exc:
        os.write(status, f"error {type(exc).__name__}: {exc}\n".encode())
        return 126
    if pid == 0:
        _child(config, status, home)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))  # the host's wall-clock stop
    return _wait_and_report(pid, status)


if __name__ == "__main__":
    sys.exit(main())

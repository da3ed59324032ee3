"""Launch one sandboxed run and wait for it: the mechanics under :class:`~lit_memopt.rewards.sandbox.Sandbox`.

Two launchers: ``bwrap`` (bubblewrap does the namespaces, the minimal filesystem, no_new_privs and
loads the seccomp filter) and ``direct`` (the bootstrap unshares itself, as before bubblewrap; the
host tree stays visible read-only to the private uid). The trainer enforces the wall clock and the
run's summed CPU time; it waits on a pidfd (no polling) and kills the whole run with one signal.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

from lit_memopt.rewards.sandbox._bootstrap import BOOTSTRAP
from lit_memopt.rewards.sandbox.cgroups import SlotGroup
from lit_memopt.rewards.sandbox.policy import WORKDIR, bwrap_argv, seccomp_bpf


def scrubbed_env(home: str) -> dict[str, str]:
    # Built from scratch: nothing of the trainer's environment (tokens, paths, secrets) is passed on.
    # PYTHONHASHSEED fixes set/dict-of-str ordering so outputs are reproducible across runs.
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": home,
            "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"}


@dataclass
class RunSpec:
    """Everything one run needs besides the program and its input."""

    launcher: str                 # "bwrap" or "direct"
    python: str
    bwrap: str | None
    features: dict[str, bool]     # what to set up (net, mount, pid, ipc, uts, keyring, seccomp, ...)
    uid: int | None               # private uid, or None to keep the trainer's
    rlimits: dict[str, int]       # CPU (s), AS, FSIZE (bytes), NOFILE, CORE
    nproc: int
    tmpfs_bytes: int
    wall_time_s: float
    cpu_time_s: float
    group: SlotGroup | None = None
    probe: bool = False


@dataclass
class RunResult:
    returncode: int | None
    outcome: dict
    stdout: bytes
    stderr: bytes
    wall_s: float
    cpu_s: float | None           # summed over the run's processes (cgroup), when known
    oom_killed: bool


# sh -c: write our own pid into each of the N cgroup.procs files given, then become the launcher.
_JOIN_CGROUP = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'


def _config_words(spec: RunSpec, status_fd: int, seccomp_fd: int | None) -> str:
    f = spec.features
    words = {
        "probe": int(spec.probe), "launcher": spec.launcher, "status": status_fd,
        "seccomp_fd": "-" if seccomp_fd is None else seccomp_fd,
        "keyring": int(f.get("keyring", False)), "uid": -1 if spec.uid is None else spec.uid, "nproc": spec.nproc,
        "tmpfs_bytes": spec.tmpfs_bytes,
        **{k: int(f.get(k, False)) for k in ("net", "mount", "pid", "ipc", "uts")},
        **{k: int(v) for k, v in spec.rlimits.items()},
    }
    return " ".join(f"{k}={v}" for k, v in words.items())


def _memfd(name: str, data: bytes = b"") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    if data:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_fd(fd: int, limit: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, limit)


def _drain(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    try:
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    except BlockingIOError:
        pass
    return b"".join(chunks)


def execute(spec: RunSpec, program: str, stdin: bytes, output_limit: int) -> RunResult:
    """Run ``program`` once under ``spec``; never leaves a process or a descriptor behind."""
    to_close: list[int] = []
    in_child: list[int] = []
    tmpdir = None

    def pipe() -> tuple[int, int]:
        r, w = os.pipe()
        to_close.extend((r, w))
        return r, w

    proc = None
    pidfd = -1
    try:
        status_r, status_w = pipe()
        in_child.append(status_w)
        seccomp_r = None
        bpf = seccomp_bpf()[0] if spec.features.get("seccomp") else None
        if spec.features.get("seccomp") and bpf is None:
            raise RuntimeError("seccomp filter unavailable")
        if bpf is not None:
            seccomp_r, seccomp_w = pipe()
            in_child.append(seccomp_r)
            os.write(seccomp_w, bpf)  # a few KiB: fits the pipe buffer, read by the child at start
            os.close(seccomp_w)
            to_close.remove(seccomp_w)
        f_in, f_out, f_err = _memfd("stdin", stdin), _memfd("stdout"), _memfd("stderr")
        to_close += [f_in, f_out, f_err]
        tail = [spec.python, "-I", "-S", "-B", "-c", BOOTSTRAP]
        if spec.launcher == "bwrap":
            argv = bwrap_argv(spec.bwrap or "bwrap", spec.python, net=spec.features.get("net", False),
                              pid=spec.features.get("pid", False), uid_drop=spec.uid is not None,
                              tmpfs_bytes=spec.tmpfs_bytes, seccomp_fd=seccomp_r)
            argv += tail + [_config_words(spec, status_w, None), program]
            cwd, home = "/", WORKDIR
        else:
            tmpdir = tempfile.mkdtemp(prefix="lit_memopt_sandbox_")
            os.chmod(tmpdir, 0o1777 if spec.uid is not None else 0o700)
            argv = tail + [_config_words(spec, status_w, seccomp_r), program]
            cwd = home = tmpdir
        if spec.group is not None:
            # The launcher joins the slot's cgroup itself before its first fork: every process of the
            # run is born inside (moving a process later would leave the ones it already forked out).
            spec.group.settle()
            argv = ["/bin/sh", "-c", _JOIN_CGROUP, "sh", str(len(spec.group.dirs)),
                    *(os.path.join(d, "cgroup.procs") for d in spec.group.dirs.values()), *argv]
        cpu0, oom0 = spec.group.counters() if spec.group is not None else (0.0, 0)
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdin=f_in, stdout=f_out, stderr=f_err, cwd=cwd, env=scrubbed_env(home),
                                start_new_session=True, close_fds=True, pass_fds=tuple(in_child),
                                umask=0o022)  # the directories bwrap creates for binds must be traversable by the uid
        for fd in in_child:
            os.close(fd)
            to_close.remove(fd)
        pidfd = os.pidfd_open(proc.pid)
        outcome = _wait(spec, proc, pidfd, start, cpu0)
        wall = time.monotonic() - start
        returncode = proc.wait()
        if not spec.features.get("pid"):
            _kill_leftovers(proc, spec)
        if not outcome:
            try:
                code, sig, cpu = _drain(status_r).decode().split()
                outcome = {"exit": None if int(code) < 0 else int(code), "signal": int(sig), "cpu_s": float(cpu)}
            except ValueError:
                outcome = {}
        cpu_used, ooms = (None, 0)
        if spec.group is not None:
            cpu1, oom1 = spec.group.counters()
            cpu_used, ooms = cpu1 - cpu0, oom1 - oom0
        return RunResult(returncode, outcome, _read_fd(f_out, output_limit), _read_fd(f_err, output_limit), wall,
                         cpu_used, ooms > 0)
    finally:
        if proc is not None and proc.poll() is None:  # only on an exception above
            _kill(proc)
            proc.wait()
        if pidfd >= 0:
            os.close(pidfd)
        for fd in to_close:
            os.close(fd)
        if tmpdir is not None:
            import shutil

            shutil.rmtree(tmpdir, ignore_errors=True)


def _kill(proc: subprocess.Popen) -> None:
    # bwrap: its init dies with it (--die-with-parent), and with the init the PID namespace.
    # direct: the ns-init has PR_SET_PDEATHSIG; the process group covers the no-PID-namespace case.
    for kill in (os.killpg, os.kill):
        try:
            kill(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_leftovers(proc: subprocess.Popen, spec: RunSpec) -> None:
    # No PID namespace: the process group, and with a private uid every process of that uid
    # (kill(-1) issued as that uid also reaches grandchildren that left the group with setsid()).
    _kill(proc)
    if spec.uid is not None:
        subprocess.run([spec.python, "-I", "-S", "-c", "import os\ntry: os.kill(-1, 9)\nexcept OSError: pass"],
                       user=spec.uid, group=spec.uid, extra_groups=[], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={}, cwd="/", timeout=30)


def _wait(spec: RunSpec, proc: subprocess.Popen, pidfd: int, start: float, cpu0: float) -> dict:
    """Block until the run ends; kill it at the wall clock or when its processes together pass the CPU limit."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    deadline = start + spec.wall_time_s
    cpu_summed = spec.group is not None and spec.features.get("cgroup_cpu", False)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _kill(proc)
            return {"timeout": True}
        step = remaining
        if cpu_summed:
            # One CPU of bandwidth: CPU used <= wall time elapsed, so nothing can pass the limit sooner.
            used = spec.group.counters()[0] - cpu0
            if used >= spec.cpu_time_s:
                _kill(proc)
                return {"cpu_timeout": True, "cpu_s": used}
            step = min(remaining, max(spec.cpu_time_s - used, 0.02))
        if poller.poll(step * 1000.0 + 1):
            return {}

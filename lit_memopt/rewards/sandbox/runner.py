"""Launch one sandboxed run and wait for it: the mechanics under :class:`~lit_memopt.rewards.sandbox.Sandbox`.

A run is forked by the slot's fork server (see :mod:`.zygote`; inside bubblewrap, or on the host
tree with the ``direct`` launcher), or, where runs cannot get their own mount and PID namespaces, is
a new interpreter. Either way the bootstrap sets up the namespaces, keyring, no_new_privs and
seccomp filter of the run. The trainer enforces the wall clock and the run's summed
CPU time; it blocks on a pidfd or the fork server's socket (no polling) and kills the whole run with
one signal.
"""

from __future__ import annotations

import os
import select
import signal
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

from lit_memopt.rewards.sandbox._bootstrap import BOOTSTRAP
from lit_memopt.rewards.sandbox.cgroups import SlotGroup
from lit_memopt.rewards.sandbox.policy import seccomp_bpf
from lit_memopt.rewards.sandbox.zygote import Zygote


def child_uid(slot: int) -> int:
    # A uid no one else uses, unique per (trainer process, pool slot): RLIMIT_NPROC then counts
    # only this run's processes, and the bootstrap (root) is out of the program's reach.
    return 200_000 + os.getpid() * 64 + slot


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
    features: dict[str, bool]     # what to set up (net, mount, pid, ipc, uts, keyring, seccomp, ...)
    uid: int | None               # private uid, or None to keep the trainer's
    rlimits: dict[str, int]       # CPU (s), AS, FSIZE (bytes), NOFILE, CORE
    nproc: int
    tmpfs_bytes: int
    wall_time_s: float
    cpu_time_s: float
    group: SlotGroup | None = None
    zygote: Zygote | None = None  # the slot's fork server; None: a new interpreter per run
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


def _config_words(spec: RunSpec, status_fd: int, seccomp_fd: int | str | None) -> str:
    f = spec.features
    words = {
        "probe": int(spec.probe), "status": status_fd,
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
    tmpdir = None
    proc = None
    try:
        status_r, status_w = os.pipe()
        to_close += [status_r, status_w]
        f_in, f_out, f_err = _memfd("stdin", stdin), _memfd("stdout"), _memfd("stderr")
        to_close += [f_in, f_out, f_err]
        cpu0, oom0 = spec.group.counters() if spec.group is not None else (0.0, 0)
        if spec.group is not None:
            spec.group.settle()
        start = time.monotonic()
        if spec.zygote is not None:
            first_pid = spec.zygote.submit(_config_words(spec, -1, "zygote" if spec.features.get("seccomp") else None),
                                           program, [f_in, f_out, f_err, status_w])
            kill = lambda: _kill_pid(first_pid)  # noqa: E731 - the fork server's child: its init and namespace die with it
            outcome = _wait(spec, spec.zygote.ready, kill, start, cpu0)
            wall = time.monotonic() - start
            returncode = spec.zygote.wait_done()
        else:
            seccomp_r = None
            pass_fds = [status_w]
            if spec.features.get("seccomp"):
                bpf = seccomp_bpf()[0]
                if bpf is None:
                    raise RuntimeError("seccomp filter unavailable")
                seccomp_r, seccomp_w = os.pipe()
                to_close.append(seccomp_r)
                os.write(seccomp_w, bpf)  # a few KiB: fits the pipe buffer, read by the child at start
                os.close(seccomp_w)
                pass_fds.append(seccomp_r)
            tmpdir = tempfile.mkdtemp(prefix="lit_memopt_sandbox_")
            os.chmod(tmpdir, 0o1777 if spec.uid is not None else 0o700)
            argv = [spec.python, "-I", "-S", "-B", "-c", BOOTSTRAP, _config_words(spec, status_w, seccomp_r), program]
            if spec.group is not None:
                argv = join_cgroup_argv(spec.group) + argv
            proc = subprocess.Popen(argv, stdin=f_in, stdout=f_out, stderr=f_err, cwd=tmpdir, env=scrubbed_env(tmpdir),
                                    start_new_session=True, close_fds=True, pass_fds=tuple(pass_fds))
            outcome = _wait(spec, _exit_waiter(proc, to_close), lambda: _kill_group(proc), start, cpu0)
            wall = time.monotonic() - start
            returncode = proc.wait()
            if not spec.features.get("pid"):
                _kill_leftovers(proc, spec)
        os.close(status_w)
        to_close.remove(status_w)
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
            _kill_group(proc)
            proc.wait()
        for fd in to_close:
            os.close(fd)
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _exit_waiter(proc: subprocess.Popen, to_close: list[int]) -> Callable[[float], bool]:
    """``wait(timeout_s) -> exited``: blocking on a pidfd (Linux >= 5.3), else Popen's own (polling) wait."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        def polled(timeout_s: float) -> bool:
            try:
                proc.wait(timeout=timeout_s)
                return True
            except subprocess.TimeoutExpired:
                return False
        return polled
    to_close.append(pidfd)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return lambda timeout_s: bool(poller.poll(timeout_s * 1000.0 + 1))


def join_cgroup_argv(group: SlotGroup) -> list[str]:
    """``sh -c`` in front of a command: it joins the slot's cgroup itself before its first fork, so
    every process of the run is born inside (moving a process later would leave the ones it already forked out)."""
    return ["/bin/sh", "-c", _JOIN_CGROUP, "sh", str(len(group.dirs)),
            *(os.path.join(d, "cgroup.procs") for d in group.dirs.values())]


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    # A new interpreter per run: its ns-init has PR_SET_PDEATHSIG (the PID namespace dies with it);
    # the process group covers the no-PID-namespace case.
    for kill in (os.killpg, os.kill):
        try:
            kill(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_leftovers(proc: subprocess.Popen, spec: RunSpec) -> None:
    # No PID namespace: the process group, and with a private uid every process of that uid
    # (kill(-1) issued as that uid also reaches grandchildren that left the group with setsid()).
    _kill_group(proc)
    if spec.uid is not None:
        subprocess.run([spec.python, "-I", "-S", "-c", "import os\ntry: os.kill(-1, 9)\nexcept OSError: pass"],
                       user=spec.uid, group=spec.uid, extra_groups=[], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={}, cwd="/", timeout=30)


def _wait(spec: RunSpec, wait: Callable[[float], bool], kill: Callable[[], None], start: float, cpu0: float) -> dict:
    """Block until the run ends (``wait(timeout_s)`` true); kill it at the wall clock or when its processes
    together pass the CPU limit. Returns ``{}`` when it ended by itself."""
    deadline = start + spec.wall_time_s
    cpu_summed = spec.group is not None and spec.features.get("cgroup_cpu", False)
    # Without a CPU quota, the run's processes burn at most this many CPUs at once.
    width = max(1, min(spec.nproc + 1, os.cpu_count() or 1))
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            kill()
            return {"timeout": True}
        step = remaining
        if cpu_summed:
            used = spec.group.counters()[0] - cpu0
            if used >= spec.cpu_time_s:
                kill()
                return {"cpu_timeout": True, "cpu_s": used}
            step = min(remaining, max((spec.cpu_time_s - used) / width, 0.01))
        if wait(step):
            return {}

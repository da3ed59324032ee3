"""A fork server per pool slot: every run is forked from a clean, pre-started interpreter.

Starting bubblewrap and a Python interpreter costs more than the run itself (~15 ms of the ~35 ms a
run took). The zygote pays it once per slot: under bubblewrap it sees only the minimal read-only
filesystem and keeps only ``CAP_SYS_ADMIN``/``CAP_SETUID``/``CAP_SETGID`` (without bubblewrap it
is a root process on the host tree, as the old per-run bootstrap was); it never runs generated
code. For each run it forks a child that executes the bootstrap in ``direct`` mode: new IPC, UTS,
network, PID and mount namespaces, fresh tmpfs on the working directory, ``/tmp`` and ``/dev/shm``,
a fresh session keyring, no_new_privs and the seccomp filter, the private uid and the rlimits. So
nothing a run creates (files, IPC objects, processes, keys) is seen by the next one, exactly as
with a new bubblewrap per run, and the zygote itself stays untouched (the program only ever runs
in a forked copy). The trainer talks to it over a ``SOCK_SEQPACKET`` pair: one message per run
carrying the configuration, the program and the run's stdin/stdout/stderr/status descriptors.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess

from lit_memopt.rewards.sandbox._bootstrap import BOOTSTRAP

# Runs inside bubblewrap: python -I -S -B -c ZYGOTE <socket fd> <seccomp fd or -> BOOTSTRAP
ZYGOTE = r"""
import os, sys, socket, resource, ctypes, _ctypes
sock = socket.socket(fileno=int(sys.argv[1]))
bpf = None
if sys.argv[2] != "-":
    parts = []
    while True:
        chunk = os.read(int(sys.argv[2]), 65536)
        if not chunk:
            break
        parts.append(chunk)
    os.close(int(sys.argv[2]))
    bpf = b"".join(parts)
code = compile(sys.argv[3], "<bootstrap>", "exec")
while True:
    try:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
    except OSError:
        os._exit(0)
    if not msg or len(fds) != 4:
        os._exit(0)  # the trainer is gone (or speaks nonsense): nothing to serve
    words, program = msg.decode("utf-8").split("\0", 1)
    pid = os.fork()
    if pid == 0:
        try:
            sock.close()
            for target, fd in enumerate(fds[:3]):
                os.dup2(fd, target)
                os.close(fd)
            sys.argv = ["<bootstrap>", "%s status=%d" % (words, fds[3]), program]
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__, "ZYGOTE_BPF": bpf})
        finally:
            os._exit(0)
    for fd in fds:
        os.close(fd)
    sock.send(b"P%d" % pid)
    _, status = os.waitpid(pid, 0)
    sock.send(b"D%d" % os.waitstatus_to_exitcode(status))
"""


class Zygote:
    """The fork server of one pool slot; started on first use, restarted if it dies."""

    def __init__(self, argv_prefix: list[str], python: str, env: dict[str, str], bpf: bytes | None, cwd: str = "/",
                 owned_dir: str | None = None) -> None:
        self._argv_prefix = argv_prefix  # cgroup join (+ bubblewrap), in front of the interpreter
        self._python = python
        self._env = env
        self._bpf = bpf
        self._cwd = cwd  # each run mounts its own tmpfs over it, in its own mount namespace
        self._owned_dir = owned_dir  # removed by close()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None

    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        keep = [child.fileno()]
        bpf_r = None
        try:
            if self._bpf is not None:
                bpf_r, bpf_w = os.pipe()
                os.write(bpf_w, self._bpf)  # a few KiB: fits the pipe buffer
                os.close(bpf_w)
                keep.append(bpf_r)
            argv = self._argv_prefix + [self._python, "-I", "-S", "-B", "-c", ZYGOTE, str(child.fileno()),
                                        "-" if bpf_r is None else str(bpf_r), BOOTSTRAP]
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=None,
                                          env=self._env, cwd=self._cwd, start_new_session=True, close_fds=True,
                                          pass_fds=tuple(keep), umask=0o022)
            self._sock = parent
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
            if bpf_r is not None:
                os.close(bpf_r)

    def ensure_started(self) -> None:
        """Start the fork server unless it is running (it boots in the background; Popen returns at once).

        Called from the thread that builds the sandbox: bubblewrap's parent-death signal follows the
        thread that started it, so a server started by a short-lived pool thread would die with it.
        """
        if self._proc is None or self._proc.poll() is not None:
            self.stop()
            self._start()

    def submit(self, words: str, program: str, fds: list[int]) -> int:
        """Send one run; returns the host pid of its first process (killing it ends the whole run)."""
        self.ensure_started()
        assert self._sock is not None
        socket.send_fds(self._sock, [f"{words}\0{program}".encode("utf-8")], fds)
        reply = self._recv(60.0)
        if not reply.startswith(b"P"):
            raise RuntimeError(f"sandbox fork server did not start the run (reply {reply[:40]!r})")
        return int(reply[1:])

    def ready(self, timeout_s: float) -> bool:
        """Whether the fork server has answered (the run ended) within ``timeout_s``."""
        assert self._sock is not None
        return bool(select.select([self._sock], [], [], max(timeout_s, 0.0))[0])

    def wait_done(self) -> int:
        """The run's exit code, once the fork server has reaped it (killed runs are reaped at once)."""
        reply = self._recv(30.0)
        if not reply.startswith(b"D"):
            raise RuntimeError(f"sandbox fork server failed during the run (reply {reply[:40]!r})")
        return int(reply[1:])

    def _recv(self, timeout_s: float | None) -> bytes:
        assert self._sock is not None
        if timeout_s is not None and not select.select([self._sock], [], [], timeout_s)[0]:
            self.stop()
            raise RuntimeError("sandbox fork server did not answer")
        data = self._sock.recv(64)
        if not data:
            self.stop()
            raise RuntimeError("sandbox fork server died")
        return data

    def close(self) -> None:
        """Stop the server for good (``stop`` only stops the process; the next run would restart it)."""
        self.stop()
        if self._owned_dir is not None:
            try:
                os.rmdir(self._owned_dir)
            except OSError:
                pass
            self._owned_dir = None

    def stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            if self._proc.poll() is None:
                try:
                    os.killpg(self._proc.pid, 9)
                except (ProcessLookupError, PermissionError):
                    pass
            self._proc.wait()
            self._proc = None

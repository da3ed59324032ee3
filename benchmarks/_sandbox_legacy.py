"""Run untrusted, model-generated Python in isolated child processes and return structured verdicts.

Nothing generated ever runs in the trainer's process: every program is executed by a fresh
``python -P -s -S -B`` child. What isolates it is probed once per process (``probe_isolation``)
and enforced from then on (fail closed); see :class:`Sandbox` for the full list.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

__all__ = ["Sandbox", "SandboxLimits", "Verdict", "VERDICTS", "probe_isolation"]

#: Every verdict a run can get, in a fixed order (used for logging counts).
VERDICTS: tuple[str, ...] = ("ok", "wrong", "error", "timeout", "memory")

# Exit codes the bootstrap reserves. A program that calls sys.exit(113) itself is labelled
# "memory": harmless, since only "ok" ever earns a reward.
_EXIT_MEMORY = 113
_EXIT_SETUP_FAILED = 114

# The child's bootstrap (stdlib only; everything comes from argv). Three processes:
#   bootstrap (trainer's user, outside)  -- enforces the wall clock, reports the outcome on status_fd
#     ns-init (PID 1 of a new PID namespace when permitted)  -- reaps; its exit kills the namespace
#       worker (private uid, rlimits)  -- runs the program
# The bootstrap and ns-init never run generated code and cannot be signalled by the worker.
_BOOTSTRAP = r"""
import ctypes, json, os, resource, sys, time
cfg = json.loads(sys.argv[1])
src = sys.argv[2]
del sys.argv[1:]
sys.argv[0] = "<program>"
report = {}
status_fd = cfg["status_fd"]
def fail(what, err):
    if cfg["probe"]:
        report[what] = False
        return
    os.write(2, ("sandbox setup failed at %s: %s\n" % (what, err)).encode())
    os._exit(_SETUP_FAILED_)
def tell(obj):
    if status_fd is not None:
        os.write(status_fd, json.dumps(obj).encode())
libc = ctypes.CDLL(None, use_errno=True)
for name, flag in (("net", 0x40000000), ("mount", 0x00020000), ("pid", 0x20000000)):
    if cfg[name]:
        if libc.unshare(flag) != 0:
            fail(name, os.strerror(ctypes.get_errno()))
            cfg[name] = False
        else:
            report[name] = True
if cfg["mount"]:
    ok = libc.mount(b"none", b"/", None, 16384 | (1 << 18), None) == 0  # MS_REC | MS_PRIVATE
    size = ("size=%d,mode=0700" % cfg["tmpfs_bytes"]).encode()
    ok = ok and libc.mount(b"tmpfs", os.getcwd().encode(), b"tmpfs", 0, size) == 0
    if ok:
        os.chdir(os.getcwd())  # enter the fresh tmpfs that now sits on the working directory
        if cfg["uid"] is not None:
            os.chown(".", cfg["uid"], cfg["uid"])
        for shared in (b"/tmp", b"/var/tmp", b"/dev/shm", b"/run/lock"):
            if os.path.isdir(shared) and libc.mount(b"tmpfs", shared, b"tmpfs", 0, b"size=1m,mode=1777") != 0:
                ok = False
    if not ok:
        fail("mount", os.strerror(ctypes.get_errno()))
        cfg["mount"] = False
    else:
        report["mount"] = True
init = os.fork()
if init == 0:
    try:
        if cfg["pid"] and cfg["mount"]:
            # A /proc of the new PID namespace: the trainer's processes are not even visible.
            if libc.mount(b"proc", b"/proc", b"proc", 2 | 4 | 8, None) != 0:  # nosuid, nodev, noexec
                fail("proc", os.strerror(ctypes.get_errno()))
            else:
                report["proc"] = True
        if not cfg["pid"]:
            libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come back to us to be reaped
        worker = os.fork()
        if worker == 0:
            if status_fd is not None:
                os.close(status_fd)
            if not cfg["pid"]:
                os.setpgid(0, 0)
            for name, value in cfg["rlimits"].items():
                try:
                    resource.setrlimit(getattr(resource, name), (value[0], value[1]))
                    report[name] = True
                except (OSError, ValueError) as err:
                    fail(name, err)
            if cfg["uid"] is not None:
                try:
                    os.setgroups([])
                    os.setgid(cfg["uid"])
                    os.setuid(cfg["uid"])
                    report["uid"] = True
                except OSError as err:
                    fail("uid", err)
                try:
                    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
                    report["nproc"] = True
                except (OSError, ValueError) as err:
                    fail("nproc", err)
            if cfg["probe"]:
                try:
                    import colorsys  # rarely preloaded: can this uid still read the standard library?
                    report["stdlib"] = True
                except ImportError:
                    report["stdlib"] = False
                sys.stdout.write(json.dumps(report))
                sys.stdout.flush()
                os._exit(0)
            code = 0
            try:
                namespace = {"__name__": "__main__", "__builtins__": __builtins__}
                exec(compile(src, "<program>", "exec"), namespace)
            except MemoryError:
                os.write(2, b"MemoryError\n")
                code = _MEMORY_
            except SystemExit as stop:
                if stop.code is None or isinstance(stop.code, int):
                    code = stop.code or 0
                else:
                    sys.stderr.write(str(stop.code) + "\n")
                    code = 1
            except BaseException:
                sys.excepthook(*sys.exc_info())
                code = 1
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:
                    code = code or 1
            os._exit(code & 255)
        status, cpu = None, 0.0
        while status is None:
            try:
                pid, st, usage = os.wait4(-1, 0)
            except ChildProcessError:
                break
            if pid == worker:
                status, cpu = st, usage.ru_utime + usage.ru_stime
        if not cfg["pid"]:
            try:
                os.killpg(worker, 9)
            except OSError:
                pass
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                try:
                    if os.waitpid(-1, os.WNOHANG) == (0, 0):
                        time.sleep(0.005)
                except ChildProcessError:
                    break
        if status is not None:
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            tell({"exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None, "signal": sig, "cpu_s": cpu})
    finally:
        os._exit(0)  # as PID 1 of the namespace: the kernel now kills and reaps everything left in it
deadline = time.monotonic() + cfg["wall_time_s"]
pause = 0.001
while True:
    pid, st = os.waitpid(init, os.WNOHANG)
    if pid:
        break
    if time.monotonic() >= deadline:
        os.kill(init, 9)
        os.waitpid(init, 0)
        tell({"timeout": True})
        break
    time.sleep(pause)
    pause = min(pause * 2, 0.01)
os._exit(0)
""".replace("_SETUP_FAILED_", str(_EXIT_SETUP_FAILED)).replace("_MEMORY_", str(_EXIT_MEMORY))

# argv strings are capped by the kernel at 128 KiB each; generated programs are far smaller.
_MAX_PROGRAM_BYTES = 100_000


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run.

    Args:
        wall_time_s: wall-clock timeout; the whole process tree is killed after it.
        cpu_time_s: ``RLIMIT_CPU`` (seconds of CPU, rounded up).
        memory_mb: ``RLIMIT_AS`` (address space) in MiB.
        file_size_mb: ``RLIMIT_FSIZE`` in MiB; also bounds stdout/stderr, which go to files.
        max_processes: ``RLIMIT_NPROC`` of the sandbox's private uid (only enforced when a private
            uid is available; see :class:`Sandbox`).
        max_open_files: ``RLIMIT_NOFILE``.
        max_output_chars: stdout/stderr kept in a :class:`Verdict` (the rest is cut).

    Raises:
        ValueError: a limit that is not positive.
    """

    wall_time_s: float = 5.0
    cpu_time_s: float = 3.0
    memory_mb: int = 512
    file_size_mb: int = 4
    max_processes: int = 8
    max_open_files: int = 64
    max_output_chars: int = 4096

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s", "memory_mb", "file_size_mb", "max_processes", "max_open_files",
                     "max_output_chars"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}.")


@dataclass(frozen=True)
class Verdict:
    """What happened to one (program, stdin) run.

    ``status`` is one of :data:`VERDICTS`: ``ok`` (exit 0, and stdout matches ``expected`` when one
    was given), ``wrong`` (exit 0, stdout differs), ``error`` (exception, non-zero exit, output limit,
    sandbox refusal), ``timeout`` (wall clock or CPU limit), ``memory`` (address-space limit).
    """

    status: str
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    wall_s: float = 0.0
    detail: str = ""
    cached: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def as_dict(self) -> dict:
        return asdict(self)


_PROBE_LOCK = threading.Lock()
_PROBE_CACHE: dict[tuple, dict[str, bool]] = {}


def _rank_zero(kind: str, message: str) -> None:
    # The functions lightning.pytorch.utilities re-exports (same rank state), without importing
    # Lightning (slow): the sandbox is usable outside a Trainer. Lightning sets the rank when it is
    # imported; before that, we are a single process and plain warnings/logging do.
    from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

    if getattr(rank_zero_only, "rank", None) is not None:
        (rank_zero_warn if kind == "warn" else rank_zero_info)(message)
    elif kind == "warn":
        import warnings

        warnings.warn(message, UserWarning, stacklevel=3)
    else:
        import logging

        logging.getLogger(__name__).info(message)


def _scrubbed_env(workdir: str) -> dict[str, str]:
    # Built from scratch: nothing of the trainer's environment (tokens, paths, secrets) is passed on.
    # PYTHONHASHSEED fixes set/dict-of-str ordering so outputs are reproducible across runs.
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir,
            "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"}


def _child_uid(slot: int) -> int:
    # A uid no one else uses, unique per (trainer process, pool slot): RLIMIT_NPROC then counts
    # only this run's processes, and kill(-1) issued as this uid reaches exactly this run's tree.
    return 200_000 + os.getpid() * 64 + slot


def _interpreter_candidates(python: str | None) -> list[str]:
    if python is not None:
        return [python]
    found = []
    for path in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if path and os.path.exists(path) and path not in found:
            found.append(path)
    return found


def _probe_one(python: str, want_net: bool, want_mount: bool, want_pid: bool, want_uid: bool) -> dict[str, bool]:
    uid = _child_uid(63) if (want_uid and os.geteuid() == 0) else None
    workdir = tempfile.mkdtemp(prefix="lit_memopt_probe_")
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        cfg = {"probe": True, "net": want_net, "mount": want_mount, "pid": want_pid, "uid": uid, "nproc": 4,
               "tmpfs_bytes": 1 << 20, "rlimits": {"RLIMIT_CORE": [0, 0]}, "status_fd": None, "wall_time_s": 30.0}
        try:
            proc = subprocess.run([python, "-P", "-s", "-S", "-B", "-c", _BOOTSTRAP, json.dumps(cfg), ""],
                                  cwd=workdir, env=_scrubbed_env(workdir), stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=60, start_new_session=True)
            report = json.loads(proc.stdout.decode() or "{}")
        except (OSError, ValueError, subprocess.TimeoutExpired):
            report = {}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {name: bool(report.get(key)) for name, key in
            (("net", "net"), ("mount", "mount"), ("pid", "pid"), ("proc", "proc"), ("uid", "uid"), ("nproc", "nproc"),
             ("rlimits", "RLIMIT_CORE"), ("stdlib", "stdlib"))}


def probe_isolation(want_net: bool = True, want_mount: bool = True, want_pid: bool = True, want_uid: bool = True,
                    python: str | None = None) -> dict:
    """Find out once per process which isolation features this platform permits.

    Returns ``{"python": path, "net", "mount", "pid", "proc", "uid", "nproc", "rlimits", "stdlib": bool}``: the
    interpreter that will run programs and what its child gets. It runs the real bootstrap in
    probe mode, so it reports exactly what a run gets. With ``python=None`` the trainer's own
    interpreter is preferred; when the private uid cannot read its standard library (a Python
    installed under ``/root``, say), the first system ``python3`` whose standard library it can
    read is used instead: programs only need the standard library.
    """
    key = (want_net, want_mount, want_pid, want_uid, python)
    with _PROBE_LOCK:
        if key not in _PROBE_CACHE:
            chosen: dict | None = None
            for candidate in _interpreter_candidates(python):
                report = _probe_one(candidate, want_net, want_mount, want_pid, want_uid)
                report["stdlib"] = report["stdlib"] or not report["uid"]
                report = {"python": candidate, **report}
                if chosen is None:
                    chosen = report
                if report["stdlib"] and report["rlimits"]:
                    chosen = report
                    break
            if chosen is None:
                raise ValueError(f"Sandbox(python={python!r}): no Python interpreter found to run programs with.")
            _PROBE_CACHE[key] = chosen
        return dict(_PROBE_CACHE[key])


@dataclass
class _CacheStats:
    hits: int = 0
    misses: int = 0
    counts: Counter = field(default_factory=Counter)


class Sandbox:
    """Executes generated Python programs in isolated, resource-limited child processes.

    Every run is a fresh ``python -P -s -S -B`` process, started in its own session (process
    group), in an empty temporary working directory that is deleted afterwards, with an
    environment built from scratch (the trainer's variables are never passed on). The child then
    isolates itself before the program's first line runs:

    * ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0`` (hard limits);
    * when the trainer runs as root (namespaces need ``CAP_SYS_ADMIN``): a private network
      namespace (only a down loopback: no network); a private mount namespace with a size-limited
      tmpfs on the working directory and on ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``; a
      private PID namespace with its own ``/proc`` (the trainer's processes are invisible, and when
      the run ends the kernel kills and reaps every process left in it, including children that
      called ``setsid``: nothing outlives a run and no zombie is left, even under an init that
      does not reap); and an unprivileged uid unique to the (trainer, pool slot), with
      ``RLIMIT_NPROC`` set for it. Root ignores ``RLIMIT_NPROC``; the private uid is what makes a
      fork bomb stop at ``max_processes``. That uid cannot write the trainer's files or signal it;
    * the wall clock is enforced by the bootstrap (a root process outside the namespaces that the
      program cannot signal), with a trainer-side backstop that kills the whole process group.

    Without a PID namespace the process group is killed after every run and, with a private uid,
    every process of that uid (``kill(-1, SIGKILL)`` issued as that uid).

    Which of the namespace/uid features this platform permits is probed once per process
    (:func:`probe_isolation`, reported in :attr:`isolation`); a missing one is announced once with
    ``rank_zero_warn`` and the rest is still enforced. Once probed, a feature is required: if it
    fails later the run is refused (``error`` verdict), never silently weaker.

    stdout and stderr go to files (bounded by ``RLIMIT_FSIZE``) and are cut to
    ``max_output_chars``. Runs go through a bounded thread pool (each thread only waits on its
    child). Identical ``(program, stdin)`` pairs run once: results are cached by their SHA-256,
    and ``expected`` is compared after the cache, so the same run serves any expected output.

    Args:
        limits: :class:`SandboxLimits` of each run.
        max_workers: children running at the same time (``>= 1``, at most 63).
        cache_size: ``(program, stdin)`` results kept (LRU); 0 disables the cache.
        isolate_network: ask for a private network namespace.
        isolate_filesystem: ask for private tmpfs mounts.
        isolate_processes: ask for a private PID namespace (and its own ``/proc``).
        drop_privileges: run programs under a private unprivileged uid (root only).
        python: interpreter for the programs (standard library only); ``None`` picks one, see
            :func:`probe_isolation`.

    Raises:
        ValueError: ``max_workers`` outside ``[1, 63]`` or a negative ``cache_size``.

    Example::

        sandbox = Sandbox(SandboxLimits(wall_time_s=2.0), max_workers=4)
        verdict = sandbox.run("print(sum(map(int, input().split())))", stdin="1 2", expected="3")
        assert verdict.status == "ok"
        sandbox.close()
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        max_workers: int = 4,
        cache_size: int = 65536,
        isolate_network: bool = True,
        isolate_filesystem: bool = True,
        isolate_processes: bool = True,
        drop_privileges: bool = True,
        python: str | None = None,
    ) -> None:
        if not 1 <= int(max_workers) <= 63:
            raise ValueError(f"Sandbox(max_workers={max_workers!r}) must be in [1, 63].")
        if int(cache_size) < 0:
            raise ValueError(f"Sandbox(cache_size={cache_size!r}) must be >= 0 (0 disables the cache).")
        self.limits = limits or SandboxLimits()
        self.max_workers = int(max_workers)
        self.cache_size = int(cache_size)
        self.isolation = probe_isolation(isolate_network, isolate_filesystem, isolate_processes, drop_privileges, python)
        self._announce_isolation()
        self._pool: ThreadPoolExecutor | None = None
        self._slots: list[int] = list(range(self.max_workers))
        self._slot_lock = threading.Lock()
        self._slot_free = threading.Semaphore(self.max_workers)
        self._cache: OrderedDict[str, Verdict] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._stats = _CacheStats()

    # ------------------------------------------------------------------ public
    def run(self, program: str, stdin: str = "", expected: str | None = None) -> Verdict:
        """Execute ``program`` with ``stdin``; compare stdout with ``expected`` when given."""
        return self._judge(self._execute_cached(program, stdin), expected)

    def run_many(self, jobs: Iterable[tuple[str, str] | tuple[str, str, str | None]]) -> list[Verdict]:
        """Run ``(program, stdin[, expected])`` jobs in parallel on the bounded pool, in order.

        Duplicate pairs within the batch run once (the others are cache hits).
        """
        jobs = [tuple(j) for j in jobs]
        pairs = [(j[0], j[1] if len(j) > 1 else "") for j in jobs]
        expected = [j[2] if len(j) > 2 else None for j in jobs]
        unique: dict[str, tuple[str, str]] = {}
        for program, stdin in pairs:
            unique.setdefault(self._key(program, stdin), (program, stdin))
        if len(unique) > 1 and self.max_workers > 1:
            pool = self._get_pool()
            futures = {k: pool.submit(self._execute_cached, p, s, count=False) for k, (p, s) in unique.items()}
            results = {k: f.result() for k, f in futures.items()}
        else:
            results = {k: self._execute_cached(p, s, count=False) for k, (p, s) in unique.items()}
        out = []
        seen: set[str] = set()
        with self._cache_lock:
            for (program, stdin) in pairs:
                key = self._key(program, stdin)
                verdict = results[key]
                # First occurrence of a pair that really executed counts as a miss, every other as a hit.
                if key in seen or verdict.cached:
                    self._stats.hits += 1
                    verdict = _replace(verdict, cached=True)
                else:
                    self._stats.misses += 1
                seen.add(key)
                out.append(verdict)
        return [self._judge(v, e) for v, e in zip(out, expected)]

    @property
    def cache_hit_rate(self) -> float:
        """Share of runs answered from the cache since the last :meth:`reset_stats` (0 when none)."""
        total = self._stats.hits + self._stats.misses
        return self._stats.hits / total if total else 0.0

    @property
    def verdict_counts(self) -> dict[str, int]:
        """Verdicts given since the last :meth:`reset_stats`, one entry per name in :data:`VERDICTS`."""
        return {name: int(self._stats.counts.get(name, 0)) for name in VERDICTS}

    def reset_stats(self) -> None:
        with self._cache_lock:
            self._stats = _CacheStats()

    def close(self) -> None:
        """Stop the worker pool (children never outlive their run, so nothing else is left)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict:
        # Lightning may deepcopy/pickle modules; locks and pools are rebuilt, the cache is dropped.
        return {"limits": self.limits, "max_workers": self.max_workers, "cache_size": self.cache_size,
                "isolation": self.isolation}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._pool = None
        self._slots = list(range(self.max_workers))
        self._slot_lock = threading.Lock()
        self._slot_free = threading.Semaphore(self.max_workers)
        self._cache = OrderedDict()
        self._cache_lock = threading.Lock()
        self._stats = _CacheStats()

    # ----------------------------------------------------------------- private
    _announced: set[tuple] = set()

    def _announce_isolation(self) -> None:
        key = tuple(sorted(self.isolation.items()))
        if key in Sandbox._announced:
            return
        Sandbox._announced.add(key)
        missing = [name for name, on in self.isolation.items() if on is False]
        if not self.isolation["net"]:
            _rank_zero("warn", "Sandbox: this platform does not permit a private network namespace; generated programs "
                           "CAN open network connections (the other limits still apply).")
        if not (self.isolation["uid"] and self.isolation["nproc"]):
            _rank_zero("warn", "Sandbox: no private unprivileged uid available (needs root); RLIMIT_NPROC then counts "
                           "all of this user's processes and programs run as the trainer's user. The process group "
                           "is still killed after every run.")
        if not self.isolation["pid"]:
            _rank_zero("warn", "Sandbox: no private PID namespace on this platform; leftover processes are killed by "
                               "process group (and by uid when a private uid is in use) after every run.")
        if not self.isolation["stdlib"]:
            _rank_zero("warn", f"Sandbox: the private uid cannot read the standard library of {self.isolation['python']}; "
                           "programs can import only modules built into the interpreter. Pass Sandbox(python=...) "
                           "with a world-readable interpreter.")
        _rank_zero("info", f"Sandbox isolation: {self.isolation}" + (f" (missing: {missing})" if missing else ""))

    def _get_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="lit_memopt_sandbox")
        return self._pool

    @staticmethod
    def _key(program: str, stdin: str) -> str:
        h = hashlib.sha256()
        for part in (program, stdin):
            data = part.encode("utf-8", "surrogatepass")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()

    def _judge(self, verdict: Verdict, expected: str | None) -> Verdict:
        status = verdict.status
        if status == "ok" and expected is not None and verdict.stdout.strip() != str(expected).strip():
            status = "wrong"
        with self._cache_lock:
            self._stats.counts[status] += 1
        return verdict if status == verdict.status else _replace(verdict, status=status)

    def _execute_cached(self, program: str, stdin: str, *, count: bool = True) -> Verdict:
        key = self._key(program, stdin)
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                if count:
                    self._stats.hits += 1
                return _replace(hit, cached=True)
        verdict = self._execute(program, stdin)
        with self._cache_lock:
            if count:
                self._stats.misses += 1
            if self.cache_size:
                self._cache[key] = verdict
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return verdict

    def _acquire_slot(self) -> int:
        self._slot_free.acquire()
        with self._slot_lock:
            return self._slots.pop()

    def _release_slot(self, slot: int) -> None:
        with self._slot_lock:
            self._slots.append(slot)
        self._slot_free.release()

    def _execute(self, program: str, stdin: str) -> Verdict:
        if not isinstance(program, str) or not isinstance(stdin, str):
            return Verdict("error", detail="program and stdin must be str")
        if len(program.encode("utf-8", "surrogatepass")) > _MAX_PROGRAM_BYTES:
            return Verdict("error", detail=f"program longer than {_MAX_PROGRAM_BYTES} bytes")
        if "\x00" in program:
            return Verdict("error", detail="program contains a NUL byte")
        slot = self._acquire_slot()
        try:
            return self._execute_in_slot(program, stdin, slot)
        finally:
            self._release_slot(slot)

    def _execute_in_slot(self, program: str, stdin: str, slot: int) -> Verdict:
        lim = self.limits
        use_uid = self.isolation["uid"] and self.isolation["nproc"]
        uid = _child_uid(slot) if use_uid else None
        fsize = lim.file_size_mb << 20
        rlimits = {
            "RLIMIT_CPU": [int(-(-lim.cpu_time_s // 1)), int(-(-lim.cpu_time_s // 1)) + 1],
            "RLIMIT_AS": [lim.memory_mb << 20, lim.memory_mb << 20],
            "RLIMIT_FSIZE": [fsize, fsize],
            "RLIMIT_NOFILE": [lim.max_open_files, lim.max_open_files],
            "RLIMIT_CORE": [0, 0],
        }
        cfg = {"probe": False, "net": self.isolation["net"], "mount": self.isolation["mount"],
               "pid": self.isolation["pid"], "uid": uid, "nproc": lim.max_processes, "tmpfs_bytes": fsize * 4,
               "rlimits": rlimits, "status_fd": None, "wall_time_s": lim.wall_time_s}
        # Private directory (root-only) for the captured streams; the working directory inside it is
        # the only place the program may write (a private tmpfs when mount namespaces are permitted).
        base = tempfile.mkdtemp(prefix="lit_memopt_sandbox_")
        workdir = os.path.join(base, "work")
        os.mkdir(workdir, 0o700)
        if uid is not None:
            os.chown(workdir, uid, uid)
        status_read, status_write = os.pipe()
        cfg["status_fd"] = status_write
        start = time.monotonic()
        proc = None
        outcome: dict = {}
        try:
            with open(os.path.join(base, "stdin"), "w+b") as f_in, open(os.path.join(base, "stdout"), "w+b") as f_out, \
                    open(os.path.join(base, "stderr"), "w+b") as f_err:
                f_in.write(stdin.encode("utf-8", "surrogatepass"))
                f_in.seek(0)
                try:
                    proc = subprocess.Popen(
                        [self.isolation["python"], "-P", "-s", "-S", "-B", "-c", _BOOTSTRAP, json.dumps(cfg), program],
                        stdin=f_in, stdout=f_out, stderr=f_err, cwd=workdir, env=_scrubbed_env(workdir),
                        start_new_session=True, close_fds=True, pass_fds=(status_write,),
                    )
                finally:
                    os.close(status_write)
                try:
                    # The bootstrap enforces the wall clock itself; this is only a backstop.
                    returncode = proc.wait(timeout=lim.wall_time_s + 10.0)
                except subprocess.TimeoutExpired:
                    outcome = {"timeout": True}
                    returncode = None
                self._kill_tree(proc, uid)
                if returncode is None:
                    returncode = proc.wait()
                wall = time.monotonic() - start
                outcome = outcome or self._read_status(status_read)
                stdout = self._read_capped(f_out)
                stderr = self._read_capped(f_err)
        finally:
            os.close(status_read)
            if proc is not None and proc.poll() is None:  # only on an exception above
                self._kill_tree(proc, uid)
                proc.wait()
            shutil.rmtree(base, ignore_errors=True)
        return self._classify(returncode, outcome, stdout, stderr, wall)

    @staticmethod
    def _read_status(fd: int) -> dict:
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
        try:
            return json.loads(b"".join(chunks).decode() or "{}")
        except ValueError:
            return {}

    def _read_capped(self, handle) -> str:
        handle.flush()
        handle.seek(0)
        data = handle.read(self.limits.max_output_chars * 4 + 4)
        return data.decode("utf-8", "replace")[: self.limits.max_output_chars]

    def _kill_tree(self, proc: subprocess.Popen, uid: int | None) -> None:
        # With a PID namespace everything is already gone (killed and reaped by the kernel when the
        # namespace's init exited); this is the backstop for platforms without one.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if uid is not None and not self.isolation["pid"]:
            # kill(-1) as that uid signals every process it owns, atomically w.r.t. fork; this
            # also reaches grandchildren that left the process group with setsid().
            subprocess.run(["/bin/kill", "-9", "-1"] if os.path.exists("/bin/kill") else
                           [self.isolation["python"], "-S", "-c", "import os\ntry: os.kill(-1, 9)\nexcept OSError: pass"],
                           user=uid, group=uid, extra_groups=[], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={}, cwd="/", timeout=30)

    def _classify(self, returncode: int, outcome: dict, stdout: str, stderr: str, wall: float) -> Verdict:
        lim = self.limits
        exit_code, sig = outcome.get("exit"), outcome.get("signal") or 0
        if outcome.get("timeout"):
            return Verdict("timeout", stdout, stderr, None, wall, f"wall clock > {lim.wall_time_s}s")
        # Soft RLIMIT_CPU sends SIGXCPU, the hard one SIGKILL; any other SIGKILL (the program killing
        # its own process group, say) is an error.
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and outcome.get("cpu_s", 0.0) >= lim.cpu_time_s):
            return Verdict("timeout", stdout, stderr, -sig, wall, f"CPU time > {lim.cpu_time_s}s")
        if exit_code == _EXIT_MEMORY or (exit_code and "MemoryError" in stderr[-400:]):
            return Verdict("memory", stdout, stderr, exit_code, wall, f"address space > {lim.memory_mb} MiB")
        if sig == signal.SIGXFSZ or (exit_code and "File too large" in stderr[-400:]):
            return Verdict("error", stdout, stderr, exit_code, wall, f"output/file > {lim.file_size_mb} MiB")
        if exit_code == _EXIT_SETUP_FAILED or returncode == _EXIT_SETUP_FAILED:
            return Verdict("error", stdout, stderr, _EXIT_SETUP_FAILED, wall, "sandbox setup failed; run refused")
        if sig:
            return Verdict("error", stdout, stderr, -sig, wall, f"killed by signal {sig}")
        if exit_code is None:
            return Verdict("error", stdout, stderr, returncode, wall, f"sandbox failure (bootstrap exit {returncode})")
        if exit_code != 0:
            last = stderr.strip().splitlines()[-1:] or [f"exit code {exit_code}"]
            return Verdict("error", stdout, stderr, exit_code, wall, last[0][:200])
        return Verdict("ok", stdout, stderr, 0, wall)


def _replace(verdict: Verdict, **changes: object) -> Verdict:
    from dataclasses import replace

    return replace(verdict, **changes)


def verdict_summary(verdicts: Sequence[Verdict]) -> dict[str, int]:
    """Count ``verdicts`` by status, one entry per name in :data:`VERDICTS`."""
    counts = Counter(v.status for v in verdicts)
    return {name: int(counts.get(name, 0)) for name in VERDICTS}

"""The :class:`Sandbox`: verdicts, limits, the bounded cache and the worker pool over :mod:`.runner`."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Sequence

from lit_memopt.rewards.sandbox._bootstrap import EXIT_MEMORY, EXIT_SETUP_FAILED
from lit_memopt.rewards.sandbox.cgroups import SlotGroup, create_slot_groups
from lit_memopt.rewards.sandbox.probe import FEATURES, make_zygote, probe_isolation, summary_line, uses_fork_server
from lit_memopt.rewards.sandbox.runner import RunSpec, child_uid, execute
from lit_memopt.rewards.sandbox.zygote import Zygote

_child_uid = child_uid  # the old private name, still imported by tests

#: Every verdict a run can get, in a fixed order (used for logging counts).
VERDICTS: tuple[str, ...] = ("ok", "wrong", "error", "timeout", "memory")

# argv strings are capped by the kernel at 128 KiB each; generated programs are far smaller.
MAX_PROGRAM_BYTES = 100_000
MAX_STDIN_BYTES = 16 << 20


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run.

    Args:
        wall_time_s: wall-clock timeout; the whole run is killed after it.
        cpu_time_s: CPU seconds of the whole run (all its processes, through the slot's cgroup) and
            ``RLIMIT_CPU`` of each process.
        memory_mb: memory of the whole run (cgroup) and ``RLIMIT_AS`` of each process, in MiB.
        file_size_mb: ``RLIMIT_FSIZE`` in MiB; also bounds stdout/stderr.
        max_processes: processes of the run (cgroup ``pids.max``) and ``RLIMIT_NPROC`` of its private uid.
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
    invalid input, sandbox refusal), ``timeout`` (wall clock or CPU limit), ``memory`` (memory limit).
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

    def nbytes(self) -> int:
        """Approximate memory the verdict holds (its strings and the object), for the cache bound."""
        return 200 + 4 * (len(self.stdout) + len(self.stderr) + len(self.detail))


def _rank_zero(kind: str, message: str) -> None:
    # Inside a Trainer, Lightning's own functions (its logger is the one users see); otherwise the
    # ones it builds on, without importing Lightning (slow): the sandbox is usable outside a Trainer.
    if "lightning.pytorch" in sys.modules:
        from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

        (rank_zero_warn if kind == "warn" else rank_zero_info)(message)
        return
    from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

    if getattr(rank_zero_only, "rank", None) is not None:
        (rank_zero_warn if kind == "warn" else rank_zero_info)(message)
    elif kind == "warn":
        import warnings

        warnings.warn(message, UserWarning, stacklevel=3)
    else:
        import logging

        logging.getLogger(__name__).info(message)


def _rlimits(limits: SandboxLimits) -> dict[str, int]:
    return {"CPU": int(-(-limits.cpu_time_s // 1)), "AS": limits.memory_mb << 20, "FSIZE": limits.file_size_mb << 20,
            "NOFILE": limits.max_open_files, "CORE": 0}


@dataclass
class _CacheStats:
    hits: int = 0
    misses: int = 0
    counts: Counter = field(default_factory=Counter)


class Sandbox:
    """Executes generated Python programs in isolated, resource-limited child processes.

    Every run is a fresh ``python -I -S -B`` process with an environment built from scratch. With
    bubblewrap installed and the trainer running as root, a run gets (each probed, see below):

    * new network (a down loopback only), IPC (System V and POSIX IPC objects die with the run and
      are invisible to other runs), UTS, PID (its own ``/proc``; when the run ends the kernel kills
      every process left in it) and mount namespaces;
    * a minimal filesystem: an empty read-only tmpfs root with only the interpreter, its standard
      library (``site-packages`` hidden) and the shared libraries it loads bind-mounted read-only,
      a minimal ``/dev``, and size-limited tmpfs on the working directory, ``/tmp`` and ``/dev/shm``.
      Neither the project nor the trainer's files exist there;
    * a fresh session keyring, ``PR_SET_NO_NEW_PRIVS`` (setuid binaries gain nothing) and a
      libseccomp filter refusing namespace creation, mount, ptrace, keyring calls, socket families
      other than ``AF_UNIX``/``AF_INET``/``AF_INET6``, and privileged or filter-bypassing calls
      (:mod:`.policy`);
    * an unprivileged uid unique to the (trainer, pool slot), with ``RLIMIT_NPROC``; the bootstrap
      that reports the outcome stays root and out of the program's reach;
    * a cgroup per pool slot: memory, process count and CPU time hold for all processes of the run
      together (on top of per-process ``RLIMIT_AS``/``RLIMIT_CPU``/``RLIMIT_FSIZE``/``RLIMIT_NOFILE``).

    Each run is forked from a per-slot fork server (:mod:`.zygote`), a clean interpreter started once,
    so a run costs no interpreter start-up. Without bubblewrap (``launcher="direct"``) the same
    bootstrap unshares the namespaces and loads the same filter, but the host tree stays visible
    read-only to the private uid; without mount and PID namespaces (not root) every run is a new
    interpreter and leftovers are killed by process group and uid. Which features this
    machine grants is probed once per process by a real run (:func:`probe_isolation`) and printed in
    one line; ``require`` turns a missing feature into an error at construction. Once probed, a
    feature is required: if it fails later the run is refused (``error`` verdict), never weaker.

    Every input gets a verdict: a non-string, a lone surrogate, a NUL byte or an oversized program
    is an ``error`` with a reason; nothing a program does makes :meth:`run` or :meth:`run_many` raise.
    Identical ``(program, stdin)`` pairs run once: verdicts are cached by SHA-256, bounded by
    entries and by bytes, and ``expected`` is compared after the cache.

    Args:
        limits: :class:`SandboxLimits` of each run.
        max_workers: runs at the same time (``>= 1``, at most 63).
        cache_size: verdicts kept (LRU); 0 disables the cache.
        cache_bytes: memory the cached verdicts may hold (their output text), LRU beyond it.
        isolate_network, isolate_filesystem, isolate_processes, drop_privileges: ask for the network
            namespace; the mount/IPC/UTS namespaces and minimal filesystem; the PID namespace; the private uid.
        use_bwrap, use_seccomp, use_cgroups: ask for bubblewrap, the seccomp filter, the slot cgroups.
        require: features (names in :data:`FEATURES`, or ``"all"``) the sandbox must have; a missing one raises.
        python: interpreter for the programs (standard library only); ``None`` picks one.

    Raises:
        ValueError: ``max_workers`` outside ``[1, 63]``, a negative cache bound, an unknown ``require`` name.
        RuntimeError: a required feature this machine does not grant.

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
        cache_bytes: int = 256 << 20,
        isolate_network: bool = True,
        isolate_filesystem: bool = True,
        isolate_processes: bool = True,
        drop_privileges: bool = True,
        use_bwrap: bool = True,
        use_seccomp: bool = True,
        use_cgroups: bool = True,
        require: Sequence[str] | str = (),
        python: str | None = None,
    ) -> None:
        if not 1 <= int(max_workers) <= 63:
            raise ValueError(f"Sandbox(max_workers={max_workers!r}) must be in [1, 63].")
        if int(cache_size) < 0 or int(cache_bytes) < 0:
            raise ValueError(f"Sandbox(cache_size={cache_size!r}, cache_bytes={cache_bytes!r}) must be >= 0 (0 disables the cache).")
        required = list(FEATURES) if require == "all" else [require] if isinstance(require, str) else list(require)
        unknown = [r for r in required if r not in FEATURES]
        if unknown:
            raise ValueError(f"Sandbox(require={require!r}): unknown feature(s) {unknown}; choose from 'all' or {list(FEATURES)}.")
        self.limits = limits or SandboxLimits()
        self.max_workers = int(max_workers)
        self.cache_size = int(cache_size)
        self.cache_bytes = int(cache_bytes)
        self.require = tuple(required)
        self._options = dict(want_net=isolate_network, want_mount=isolate_filesystem, want_pid=isolate_processes,
                             want_uid=drop_privileges, python=python, want_bwrap=use_bwrap, want_seccomp=use_seccomp,
                             want_cgroup=use_cgroups)
        self.isolation = probe_isolation(isolate_network, isolate_filesystem, isolate_processes, drop_privileges, python,
                                         want_bwrap=use_bwrap, want_seccomp=use_seccomp, want_cgroup=use_cgroups)
        missing = [r for r in self.require if not self.isolation.get(r)]
        if missing:
            notes = self.isolation["notes"]
            raise RuntimeError("Sandbox(require=...): this machine does not grant " +
                               "; ".join(f"{m} ({notes.get(m, 'off')})" for m in missing) +
                               ". Install bubblewrap and pyseccomp (pip install 'lit-memopt[sandbox]'; scripts/setup.sh), run as root, "
                               "or drop it from require.")
        self._announce_isolation()
        self._setup_runtime()

    def _setup_runtime(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._slots: list[int] = list(range(self.max_workers))
        self._slot_lock = threading.Lock()
        self._slot_free = threading.Semaphore(self.max_workers)
        self._cache: OrderedDict[str, Verdict] = OrderedDict()
        self._cache_nbytes = 0
        self._cache_lock = threading.Lock()
        self._stats = _CacheStats()
        self._groups: list[SlotGroup] = []
        self._zygotes: list[Zygote] = []
        iso = self.isolation
        if iso["cgroup_memory"] or iso["cgroup_pids"] or iso["cgroup_cpu"]:
            # Headroom for bubblewrap, the fork server, and the run's bootstrap and init, which live in the group too.
            self._groups, on, why = create_slot_groups(
                f"lit_memopt_sandbox_{os.getpid()}_{id(self) & 0xFFFFFF:x}", self.max_workers,
                memory_bytes=(self.limits.memory_mb << 20) + (48 << 20), max_processes=self.limits.max_processes + 4)
            if not self._groups:
                raise RuntimeError(f"Sandbox: the slot cgroups probed at start can no longer be created ({why}).")
        if uses_fork_server(iso):
            uid_drop = bool(iso["uid"] and iso["nproc"])
            self._zygotes = [make_zygote(iso["bwrap_path"], iso["python"], self._groups[slot] if self._groups else None,
                                          uid_drop, bool(iso["seccomp"])) for slot in range(self.max_workers)]
            for zygote in self._zygotes:
                zygote.ensure_started()

    # ------------------------------------------------------------------ public
    def run(self, program: str, stdin: str = "", expected: str | None = None) -> Verdict:
        """Execute ``program`` with ``stdin``; compare stdout with ``expected`` when given. Never raises for bad input."""
        return self._judge(self._execute_cached(program, stdin), expected)

    def run_many(self, jobs: Iterable[tuple[str, str] | tuple[str, str, str | None]]) -> list[Verdict]:
        """Run ``(program, stdin[, expected])`` jobs in parallel on the bounded pool, in order.

        Duplicate pairs within the batch run once (the others are cache hits). A malformed job gets
        an ``error`` verdict in its place.
        """
        pairs: list[tuple[Any, Any]] = []
        expected: list[Any] = []
        for job in jobs:
            if isinstance(job, (tuple, list)) and 1 <= len(job) <= 3:
                pairs.append((job[0], job[1] if len(job) > 1 else ""))
                expected.append(job[2] if len(job) > 2 else None)
            else:
                pairs.append((job, None))  # refused by _invalid: a job must be a (program, stdin[, expected]) tuple
                expected.append(None)
        keys = [self._key(p, s) for p, s in pairs]
        unique: dict[str, tuple[Any, Any]] = {}
        for key, pair in zip(keys, pairs):
            unique.setdefault(key, pair)
        if len(unique) > 1 and self.max_workers > 1:
            pool = self._get_pool()
            futures = {k: pool.submit(self._execute_cached, p, s, count=False) for k, (p, s) in unique.items()}
            results = {k: f.result() for k, f in futures.items()}
        else:
            results = {k: self._execute_cached(p, s, count=False) for k, (p, s) in unique.items()}
        out = []
        seen: set[str] = set()
        with self._cache_lock:
            for key in keys:
                verdict = results[key]
                # First occurrence of a pair that really executed counts as a miss, every other as a hit.
                if key in seen or verdict.cached:
                    self._stats.hits += 1
                    verdict = replace(verdict, cached=True)
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
    def cache_nbytes(self) -> int:
        """Bytes the cached verdicts hold now (as :meth:`Verdict.nbytes` counts them)."""
        return self._cache_nbytes

    @property
    def verdict_counts(self) -> dict[str, int]:
        """Verdicts given since the last :meth:`reset_stats`, one entry per name in :data:`VERDICTS`."""
        return {name: int(self._stats.counts.get(name, 0)) for name in VERDICTS}

    def reset_stats(self) -> None:
        with self._cache_lock:
            self._stats = _CacheStats()

    def close(self) -> None:
        """Stop the worker pool and remove the slot cgroups (runs never outlive themselves)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for zygote in self._zygotes:
            zygote.close()
        self._zygotes = []
        for group in self._groups:
            group.remove()
        self._groups = []

    def __del__(self) -> None:
        for zygote in getattr(self, "_zygotes", []):
            zygote.close()
        for group in getattr(self, "_groups", []):
            group.remove()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict:
        # Lightning may deepcopy/pickle modules; locks, pools and cgroups are rebuilt, the cache is dropped.
        return {"limits": self.limits, "max_workers": self.max_workers, "cache_size": self.cache_size,
                "cache_bytes": self.cache_bytes, "require": self.require, "_options": self._options,
                "isolation": self.isolation}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup_runtime()

    # ----------------------------------------------------------------- private
    _announced: set[str] = set()

    def _announce_isolation(self) -> None:
        line = summary_line(self.isolation)
        if line in Sandbox._announced:
            return
        Sandbox._announced.add(line)
        off = [f for f in FEATURES if not self.isolation.get(f)]
        _rank_zero("warn" if off else "info", line)

    def _get_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="lit_memopt_sandbox")
        return self._pool

    @staticmethod
    def _key(program: Any, stdin: Any) -> str:
        h = hashlib.sha256()
        for part in (program, stdin):
            if isinstance(part, str):
                data = part.encode("utf-8", "surrogatepass")
            else:  # refused later with an error verdict; its key only has to exist
                try:
                    data = repr((type(part), part)).encode("utf-8", "backslashreplace")
                except Exception:  # noqa: BLE001 - an object whose repr fails still gets a verdict
                    data = f"{type(part).__qualname__}@{id(part)}".encode()
            h.update(b"s" if isinstance(part, str) else b"o")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()

    def _judge(self, verdict: Verdict, expected: Any) -> Verdict:
        status = verdict.status
        if status == "ok" and expected is not None:
            try:
                same = verdict.stdout.strip() == str(expected).strip()
            except Exception:  # noqa: BLE001 - an expected value whose str() fails cannot be matched
                same = False
            status = "ok" if same else "wrong"
        with self._cache_lock:
            self._stats.counts[status] += 1
        return verdict if status == verdict.status else replace(verdict, status=status)

    def _execute_cached(self, program: Any, stdin: Any, *, count: bool = True) -> Verdict:
        key = self._key(program, stdin)
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                if count:
                    self._stats.hits += 1
                return replace(hit, cached=True)
        verdict = self._execute(program, stdin)
        with self._cache_lock:
            if count:
                self._stats.misses += 1
            size = verdict.nbytes()
            if self.cache_size and size <= self.cache_bytes and key not in self._cache and not verdict.detail.startswith("sandbox failure"):
                self._cache[key] = verdict
                self._cache_nbytes += size
                while len(self._cache) > self.cache_size or self._cache_nbytes > self.cache_bytes:
                    _, old = self._cache.popitem(last=False)
                    self._cache_nbytes -= old.nbytes()
        return verdict

    @staticmethod
    def _invalid(program: Any, stdin: Any) -> str:
        """Why this input cannot run ("" when it can)."""
        if stdin is None and not isinstance(program, str):
            return f"a job must be a (program, stdin[, expected]) tuple, got {type(program).__name__}"
        for name, value, limit in (("program", program, MAX_PROGRAM_BYTES), ("stdin", stdin, MAX_STDIN_BYTES)):
            if not isinstance(value, str):
                return f"{name} must be str, got {type(value).__name__}"
            try:
                size = len(value.encode("utf-8"))
            except UnicodeEncodeError as exc:
                return f"{name} is not valid text: {exc.reason} at index {exc.start} ({value[exc.start:exc.end]!a})"
            if size > limit:
                return f"{name} longer than {limit} bytes ({size})"
            if name == "program" and "\x00" in value:
                return "program contains a NUL byte"
        return ""

    def _execute(self, program: Any, stdin: Any) -> Verdict:
        why = self._invalid(program, stdin)
        if why:
            return Verdict("error", detail=f"invalid input: {why}")
        slot = self._acquire_slot()
        try:
            return self._execute_in_slot(program, stdin, slot)
        except Exception as exc:  # noqa: BLE001 - one failed launch must not fail the batch; fail closed
            return Verdict("error", detail=f"sandbox failure: {type(exc).__name__}: {exc}")
        finally:
            self._release_slot(slot)

    def _acquire_slot(self) -> int:
        self._slot_free.acquire()
        with self._slot_lock:
            return self._slots.pop()

    def _release_slot(self, slot: int) -> None:
        with self._slot_lock:
            self._slots.append(slot)
        self._slot_free.release()

    def _execute_in_slot(self, program: str, stdin: str, slot: int) -> Verdict:
        iso, lim = self.isolation, self.limits
        uid = child_uid(slot) if iso["uid"] and iso["nproc"] else None
        features = {k: bool(iso[k]) for k in ("net", "mount", "pid", "ipc", "uts", "keyring", "seccomp", "cgroup_cpu")}
        spec = RunSpec(iso["launcher"], iso["python"], features, uid, _rlimits(lim), lim.max_processes,
                       (lim.file_size_mb << 20) * 4, lim.wall_time_s, lim.cpu_time_s,
                       self._groups[slot] if self._groups else None, self._zygotes[slot] if self._zygotes else None)
        result = execute(spec, program, stdin.encode("utf-8"), lim.max_output_chars * 4 + 4)
        return self._classify(result)

    def _classify(self, r: Any) -> Verdict:
        lim = self.limits
        stdout = r.stdout.decode("utf-8", "replace")[: lim.max_output_chars]
        stderr = r.stderr.decode("utf-8", "replace")[: lim.max_output_chars]
        outcome, wall = r.outcome, r.wall_s
        exit_code, sig = outcome.get("exit"), outcome.get("signal") or 0
        if outcome.get("timeout"):
            return Verdict("timeout", stdout, stderr, None, wall, f"wall clock > {lim.wall_time_s}s")
        if outcome.get("cpu_timeout"):
            return Verdict("timeout", stdout, stderr, None, wall, f"CPU time of the run > {lim.cpu_time_s}s (all processes)")
        # Soft RLIMIT_CPU sends SIGXCPU, the hard one SIGKILL; any other SIGKILL (the program killing
        # its own process group, say) is an error.
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and outcome.get("cpu_s", 0.0) >= lim.cpu_time_s):
            return Verdict("timeout", stdout, stderr, -sig, wall, f"CPU time > {lim.cpu_time_s}s")
        if r.oom_killed:
            return Verdict("memory", stdout, stderr, exit_code, wall, f"memory of the run > {lim.memory_mb} MiB (all processes)")
        if exit_code == EXIT_MEMORY or (exit_code and "MemoryError" in stderr[-400:]):
            return Verdict("memory", stdout, stderr, exit_code, wall, f"address space > {lim.memory_mb} MiB")
        if sig == signal.SIGXFSZ or (exit_code and "File too large" in stderr[-400:]):
            return Verdict("error", stdout, stderr, exit_code, wall, f"output/file > {lim.file_size_mb} MiB")
        if exit_code == EXIT_SETUP_FAILED or r.returncode == EXIT_SETUP_FAILED:
            return Verdict("error", stdout, stderr, EXIT_SETUP_FAILED, wall, "sandbox setup failed; run refused")
        if sig:
            return Verdict("error", stdout, stderr, -sig, wall, f"killed by signal {sig}")
        if exit_code is None:
            return Verdict("error", stdout, stderr, r.returncode, wall, f"sandbox failure (launcher exit {r.returncode})")
        if exit_code != 0:
            last = stderr.strip().splitlines()[-1:] or [f"exit code {exit_code}"]
            return Verdict("error", stdout, stderr, exit_code, wall, last[0][:200])
        return Verdict("ok", stdout, stderr, 0, wall)


def verdict_summary(verdicts: Sequence[Verdict]) -> dict[str, int]:
    """Count ``verdicts`` by status, one entry per name in :data:`VERDICTS`."""
    counts = Counter(v.status for v in verdicts)
    return {name: int(counts.get(name, 0)) for name in VERDICTS}

"""Find out once per process which isolation features a run really gets, by running the bootstrap.

Every feature is judged from inside a real sandboxed run (its namespaces, uid, no_new_privs and
seccomp state, its root directory, its session keyring) compared with the trainer's own view, so
the report cannot claim what the machine did not grant.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from typing import Any

from lit_memopt.rewards.sandbox.cgroups import SlotGroup, create_slot_groups
from lit_memopt.rewards.sandbox.policy import WORKDIR, bwrap_argv, interpreter_files, seccomp_bpf
from lit_memopt.rewards.sandbox.runner import RunSpec, child_uid, execute, join_cgroup_argv, scrubbed_env
from lit_memopt.rewards.sandbox.zygote import Zygote

#: Every feature the probe reports, in the order of the one-line summary.
FEATURES: tuple[str, ...] = (
    "bwrap", "net", "ipc", "uts", "pid", "mount", "proc", "minimal_fs", "uid", "nproc", "rlimits", "no_new_privs",
    "seccomp", "keyring", "cgroup_memory", "cgroup_pids", "cgroup_cpu", "stdlib",
)

_PROBE_LOCK = threading.Lock()
_PROBE_CACHE: dict[tuple, dict[str, Any]] = {}


def find_bwrap() -> str | None:
    """bubblewrap, when installed and usable: only as root (no user namespace, so the private uid works)."""
    if os.geteuid() != 0:
        return None
    return shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.path.exists(p)), None)


def interpreter_candidates(python: str | None) -> list[str]:
    if python is not None:
        return [python]
    found: list[str] = []
    for path in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        # The real binary, not a virtual environment's link: programs get the bare standard library.
        path = os.path.realpath(path) if path else path
        if path and os.path.exists(path) and path not in found:
            found.append(path)
    return found


def _own_namespaces() -> dict[str, str]:
    out = {}
    for ns in ("ipc", "uts", "net", "pid", "mnt"):
        try:
            out[ns] = os.readlink(f"/proc/self/ns/{ns}")
        except OSError:
            out[ns] = "?"
    return out


def judge(report: dict[str, str], *, launcher: str, want: dict[str, bool], uid: int | None, cgroups: dict[str, bool],
          cgroup_used: bool) -> dict[str, bool]:
    """Each feature on or off, from the ``key=value`` words a probe run printed."""
    mine = _own_namespaces()

    def new_ns(ns: str) -> bool:
        theirs = report.get(f"ns_{ns}", "?")
        return theirs not in ("?", mine.get(ns, "?"))

    root = set(filter(None, report.get("root", "").split(",")))
    expected_root = {"dev", "proc", "tmp", "program"}
    if launcher == "bwrap":
        binds, _ = interpreter_files(report["python"])
        expected_root |= {dst.split("/")[1] for _, dst in binds}
    failed = {k for k, v in report.items() if v == "0"}
    on = {
        "bwrap": launcher == "bwrap" and bool(report.get("uid")),
        "net": want["net"] and new_ns("net"),
        "ipc": want["ipc"] and new_ns("ipc"),
        "uts": want["uts"] and new_ns("uts"),
        "pid": want["pid"] and new_ns("pid"),
        "mount": want["mount"] and new_ns("mnt"),
        # Only the interpreter's files, the devices, /proc and the two tmpfs: not the host tree.
        "minimal_fs": launcher == "bwrap" and bool(root) and root <= expected_root,
        "uid": uid is not None and report.get("uid") == str(uid) and "uid" not in failed,
        "no_new_privs": report.get("NoNewPrivs") == "1",
        "seccomp": report.get("Seccomp") == "2" and report.get("family_refused") == "1",
        "keyring": int(report.get("keyring", "0") or 0) > 0,
        "cgroup_memory": cgroups.get("memory", False) and cgroup_used,
        "cgroup_pids": cgroups.get("pids", False) and cgroup_used,
        "cgroup_cpu": cgroups.get("cpu", False) and cgroup_used,
        "stdlib": report.get("stdlib") == "1",
    }
    on["proc"] = on["pid"] and on["mount"]
    on["nproc"] = on["uid"] and "nproc" not in failed
    on["rlimits"] = bool(report) and not any(k.startswith("rlimit_") for k in failed)
    return on


def probe_cache() -> tuple[threading.Lock, dict[tuple, dict[str, Any]]]:
    return _PROBE_LOCK, _PROBE_CACHE


def make_zygote(bwrap: str | None, python: str, group: SlotGroup | None, uid_drop: bool, seccomp: bool) -> Zygote:
    """The fork server of one slot: joins ``group``, then (with ``bwrap``) bubblewrap with the minimal
    filesystem, then the interpreter. Without bubblewrap it serves from an empty host directory that
    each run covers with its own tmpfs."""
    prefix = join_cgroup_argv(group) if group is not None else []
    bpf = seccomp_bpf()[0] if seccomp else None
    if bwrap:
        return Zygote(prefix + bwrap_argv(bwrap, python, uid_drop=uid_drop), python, scrubbed_env(WORKDIR), bpf)
    workdir = tempfile.mkdtemp(prefix="lit_memopt_slot_")
    os.chmod(workdir, 0o755)
    return Zygote(prefix, python, scrubbed_env(workdir), bpf, cwd=workdir, owned_dir=workdir)


def uses_fork_server(isolation: dict[str, Any]) -> bool:
    """A fork server needs each run to get its own mount and PID namespaces (nothing persists, one kill ends it)."""
    return isolation["launcher"] == "bwrap" or bool(isolation["mount"] and isolation["pid"])


def _probe_with(python: str, want: dict[str, bool]) -> dict[str, Any]:
    bwrap = find_bwrap() if want["bwrap"] else None
    launcher = "bwrap" if bwrap else "direct"
    root = os.geteuid() == 0
    notes: dict[str, str] = {}
    bpf, why = seccomp_bpf() if want["seccomp"] else (None, "not requested")
    if bpf is None:
        notes["seccomp"] = why
    if not bwrap:
        notes["bwrap"] = ("not requested (use_bwrap=False or isolate_filesystem=False)" if not want["bwrap"] else
                          "bubblewrap not installed (apt-get install bubblewrap)" if root else "needs root")
        notes["minimal_fs"] = "needs bubblewrap: the direct launcher leaves the host tree visible (read-only to the private uid)"
    if not root:
        for name in ("net", "ipc", "uts", "pid", "mount", "uid"):
            notes[name] = "needs root"
    uid = child_uid(63) if (want["uid"] and root) else None
    features = {k: want[k] and root for k in ("net", "mount", "pid", "ipc", "uts")}
    features.update(keyring=want["keyring"], seccomp=bpf is not None)
    groups, cg_on, cg_why = ([], {}, "not requested")
    if want["cgroup"]:
        groups, cg_on, cg_why = create_slot_groups(f"lit_memopt_probe_{os.getpid()}", 1, memory_bytes=256 << 20,
                                                   max_processes=16)
    if cg_why:
        for name in ("cgroup_memory", "cgroup_pids", "cgroup_cpu"):
            if not cg_on.get(name.split("_")[1]):
                notes[name] = cg_why
    group = groups[0] if groups else None
    forked = bool(bwrap) or (features["mount"] and features["pid"])
    zygote = make_zygote(bwrap, python, group, uid is not None, features["seccomp"]) if forked else None
    spec = RunSpec(launcher, python, features, uid, {"CPU": 10, "AS": 1 << 30, "FSIZE": 1 << 20, "NOFILE": 64, "CORE": 0},
                   8, 1 << 20, 30.0, 30.0, group, zygote, probe=True)
    report: dict[str, str] = {}
    try:
        result = execute(spec, "", b"", 1 << 16)
        report = dict(w.split("=", 1) for w in result.stdout.decode("utf-8", "replace").split() if "=" in w)
        if not report:
            notes.setdefault("launcher", result.stderr.decode("utf-8", "replace").strip()[:300])
        used = bool(group and (group.peak_memory_bytes() > 0 or group.counters()[0] > 0))
    except Exception as exc:  # noqa: BLE001 - a launcher this machine refuses: everything reported off
        notes["launcher"] = f"{type(exc).__name__}: {exc}"
        used = False
    finally:
        if zygote is not None:
            zygote.close()
        for g in groups:
            g.remove()
    if launcher == "bwrap" and not report:
        # bubblewrap is installed but this machine refuses what it needs: the direct launcher, saying why.
        fallback = _probe_with(python, {**want, "bwrap": False})
        fallback["notes"]["bwrap"] = f"installed but failed here: {notes.get('launcher', 'no report')}"[:300]
        return fallback
    report["python"] = python
    on = judge(report, launcher=launcher, want={k: want[k] for k in ("net", "ipc", "uts", "pid", "mount")}, uid=uid,
               cgroups=cg_on, cgroup_used=used)
    for name in FEATURES:
        if not on[name] and name not in notes and want.get(name.split("_")[0], True):
            notes[name] = "refused by this machine" if report else "probe run failed"
    return {"python": python, "launcher": launcher, "bwrap_path": bwrap, "fork_server": forked and bool(report), **on,
            "notes": notes}


def probe_isolation(want_net: bool = True, want_mount: bool = True, want_pid: bool = True, want_uid: bool = True,
                    python: str | None = None, *, want_bwrap: bool = True, want_seccomp: bool = True,
                    want_cgroup: bool = True, want_keyring: bool = True) -> dict[str, Any]:
    """Find out once per process which isolation features this platform permits.

    Returns ``{"python", "launcher", "bwrap_path", <feature>: bool for each of probe.FEATURES, "notes": {feature:
    why it is off}}``. Each feature is judged from inside a real probe run (see :mod:`.probe`). With
    ``python=None`` the trainer's own interpreter is preferred; when the private uid cannot read its
    standard library, the first system ``python3`` whose standard library it can read is used.
    """
    want = {"net": want_net, "mount": want_mount, "pid": want_pid, "uid": want_uid, "ipc": want_mount,
            "uts": want_mount, "bwrap": want_bwrap and want_mount, "seccomp": want_seccomp, "cgroup": want_cgroup,
            "keyring": want_keyring}
    key = (tuple(sorted(want.items())), python)
    lock, cache = probe_cache()
    with lock:
        if key not in cache:
            chosen: dict | None = None
            for candidate in interpreter_candidates(python):
                report = _probe_with(candidate, want)
                if chosen is None or (report["rlimits"] and not chosen["rlimits"]):
                    chosen = report
                if report["stdlib"] and report["rlimits"]:
                    chosen = report
                    break
            if chosen is None:
                raise ValueError(f"Sandbox(python={python!r}): no Python interpreter found to run programs with.")
            cache[key] = chosen
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in cache[key].items()}


def summary_line(isolation: dict[str, Any]) -> str:
    """``Sandbox isolation (bwrap, /usr/bin/python3): on: ...; OFF: ... (why)`` -- one line."""
    on = [f for f in FEATURES if isolation.get(f)]
    off = [f for f in FEATURES if not isolation.get(f)]
    notes = isolation.get("notes", {})
    off_text = ", ".join(f"{f} ({notes[f]})" if notes.get(f) else f for f in off)
    per_process = [] if isolation.get("cgroup_memory") else ["memory (RLIMIT_AS)"]
    if not isolation.get("cgroup_cpu"):
        per_process.append("CPU time (RLIMIT_CPU)")
    if not isolation.get("cgroup_pids"):
        per_process.append("processes (RLIMIT_NPROC of the private uid)" if isolation.get("nproc") else "processes (not limited)")
    server = ", fork server" if isolation.get("fork_server") else ", a new interpreter per run"
    text = f"Sandbox isolation ({isolation.get('launcher')}{server}, {isolation.get('python')}): on: {', '.join(on) or 'nothing'}"
    if off:
        text += f"; OFF: {off_text}"
    if per_process:
        text += f"; limited per process only: {', '.join(per_process)}"
    return text

"""Find out once per process which isolation features a run really gets, by running the bootstrap.

Every feature is judged from inside a real sandboxed run (its namespaces, uid, no_new_privs and
seccomp state, its root directory, its session keyring) compared with the trainer's own view, so
the report cannot claim what the machine did not grant.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from typing import Any

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
    from lit_memopt.rewards.sandbox.policy import interpreter_files

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
    text = f"Sandbox isolation ({isolation.get('launcher')}, {isolation.get('python')}): on: {', '.join(on) or 'nothing'}"
    if off:
        text += f"; OFF: {off_text}"
    if per_process:
        text += f"; limited per process only: {', '.join(per_process)}"
    return text

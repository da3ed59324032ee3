"""One control group per pool slot: memory, process and CPU limits that hold for a run's whole process tree.

``RLIMIT_AS`` and ``RLIMIT_CPU`` count per process, so four forked workers get four times the
budget; a cgroup counts them together. Slot groups are created under the trainer's own group (its
limits still bound them), on cgroup v2 when the memory and pids controllers are delegated there,
else on the v1 ``memory``/``pids``/``cpu``/``cpuacct`` hierarchies. Usage is read as a difference
between the start and end of a run, so nothing needs resetting between runs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

_ROOT = "/sys/fs/cgroup"
_CFS_PERIOD_US = 100_000


def _own_paths() -> dict[str, str]:
    """``{controller or "": path}`` of this process, from ``/proc/self/cgroup`` ("" is the v2 hierarchy)."""
    paths: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for c in controllers.split(",") if controllers else [""]:
                    paths[c.replace("name=", "")] = path
    except OSError:
        pass
    return paths


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_int(path: str, key: str | None = None) -> int:
    with open(path) as f:
        text = f.read()
    if key is None:
        return int(text.split()[0])
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


@dataclass
class SlotGroup:
    """The cgroup directories of one slot and how to read its counters."""

    version: int
    dirs: dict[str, str] = field(default_factory=dict)  # controller -> directory ("" for v2)

    def settle(self, timeout_s: float = 0.05) -> None:
        """Wait (briefly) until the last run's exited tasks are uncharged, so they do not eat ``pids.max``.

        The kernel releases a dead PID namespace's tasks a moment after their parent has reaped them;
        what still counts then is ``pids.current`` beyond the live tasks (the fork server's).
        """
        d = self.dirs.get("pids", self.dirs.get(""))
        if d is None:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(os.path.join(d, "cgroup.procs")) as f:
                live = len(f.read().split())
            if _read_int(os.path.join(d, "pids.current")) <= live:
                return
            time.sleep(0.0005)

    def counters(self) -> tuple[float, int]:
        """(CPU seconds used so far by the group, out-of-memory kills so far)."""
        if self.version == 2:
            d = self.dirs[""]
            return _read_int(os.path.join(d, "cpu.stat"), "usage_usec") / 1e6, _read_int(os.path.join(d, "memory.events"), "oom_kill")
        cpu = _read_int(os.path.join(self.dirs["cpuacct"], "cpuacct.usage")) / 1e9 if "cpuacct" in self.dirs else 0.0
        ooms = _read_int(os.path.join(self.dirs["memory"], "memory.oom_control"), "oom_kill") if "memory" in self.dirs else 0
        return cpu, ooms

    def peak_memory_bytes(self) -> int:
        """Highest memory use the group has seen (0 when the kernel does not say)."""
        for d, name in ((self.dirs.get("memory"), "memory.max_usage_in_bytes"), (self.dirs.get(""), "memory.peak")):
            if d and os.path.exists(os.path.join(d, name)):
                return _read_int(os.path.join(d, name))
        return 0

    def remove(self, wait_s: float = 2.0) -> None:
        """Delete the group's directories, once the tasks killed just before have left them."""
        deadline = time.monotonic() + wait_s
        for d in self.dirs.values():
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: a dying task is still charged to it
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.005)


def _remove_stale(parent: str) -> None:
    """Remove empty slot groups left by trainers that were killed before they could (``<prefix>_<pid>_...``)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(("lit_memopt_sandbox_", "lit_memopt_probe_")):
            continue
        pid = name.split("_")[3]
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.rmdir(os.path.join(parent, name))
            except OSError:
                pass  # still has tasks, or not ours to remove


def create_slot_groups(name: str, slots: int, *, memory_bytes: int, max_processes: int) -> tuple[list[SlotGroup], dict[str, bool], str]:
    """Create ``slots`` groups named ``<name>_<slot>``; returns them, which limits hold, and why not.

    Each group gets ``memory_bytes`` (swap included where the kernel accounts it), ``max_processes``
    tasks, and at most one CPU of bandwidth (so CPU time used never exceeds wall time, and the
    trainer can stop the run at the CPU limit summed over its processes).
    """
    own = _own_paths()
    v2_root = _ROOT if os.path.exists(os.path.join(_ROOT, "cgroup.controllers")) else os.path.join(_ROOT, "unified")
    if "" in own and os.path.exists(os.path.join(v2_root, "cgroup.controllers")):
        parent = os.path.join(v2_root, own[""].lstrip("/"))
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                delegated = set(f.read().split())
        except OSError:
            delegated = set()
        if {"memory", "pids"} <= delegated:
            _remove_stale(parent)
            groups, why = [], ""
            try:
                for slot in range(slots):
                    d = os.path.join(parent, f"{name}_{slot}")
                    os.makedirs(d, exist_ok=True)
                    groups.append(SlotGroup(2, {"": d}))
                    _write(os.path.join(d, "memory.max"), str(memory_bytes))
                    if os.path.exists(os.path.join(d, "memory.swap.max")):
                        _write(os.path.join(d, "memory.swap.max"), "0")
                    _write(os.path.join(d, "pids.max"), str(max_processes))
                    if "cpu" in delegated:
                        _write(os.path.join(d, "cpu.max"), f"{_CFS_PERIOD_US} {_CFS_PERIOD_US}")
                return groups, {"memory": True, "pids": True, "cpu": "cpu" in delegated}, ""
            except OSError as exc:
                why = f"cgroup v2 at {parent}: {exc}"
                for g in groups:
                    g.remove()
    groups = []
    on = {"memory": False, "pids": False, "cpu": False}
    why = "no writable cgroup (v2 without delegated memory+pids controllers, no v1 memory/pids hierarchies)"
    try:
        for slot in range(slots):
            group = SlotGroup(1)
            groups.append(group)
            for controller in ("memory", "pids", "cpu", "cpuacct"):
                base = os.path.join(_ROOT, controller)
                if controller not in own or not os.path.exists(os.path.join(base, "cgroup.procs")):
                    continue
                if slot == 0:
                    _remove_stale(os.path.join(base, own[controller].lstrip("/")))
                d = os.path.join(base, own[controller].lstrip("/"), f"{name}_{slot}")
                os.makedirs(d, exist_ok=True)
                group.dirs[controller] = d
            if "memory" in group.dirs:
                mem = group.dirs["memory"]
                _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
                if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                on["memory"] = True
            if "pids" in group.dirs:
                _write(os.path.join(group.dirs["pids"], "pids.max"), str(max_processes))
                on["pids"] = True
            if "cpu" in group.dirs and "cpuacct" in group.dirs:
                _write(os.path.join(group.dirs["cpu"], "cpu.cfs_period_us"), str(_CFS_PERIOD_US))
                _write(os.path.join(group.dirs["cpu"], "cpu.cfs_quota_us"), str(_CFS_PERIOD_US))
                on["cpu"] = True
        if all(on.values()):
            why = ""
        elif any(on.values()):
            why = "cgroup v1: missing " + ", ".join(k for k, v in on.items() if not v)
    except OSError as exc:
        why = f"cgroup v1: {exc}"
        on = {k: False for k in on}
    if not any(on.values()):
        for g in groups:
            g.remove()
        groups = []
    return groups, on, why

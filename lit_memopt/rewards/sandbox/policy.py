"""What a sandboxed program may do: the seccomp filter and the filesystem it sees.

The filter is compiled once in the trainer by libseccomp (through ``pyseccomp``) and handed to each
run as BPF bytes on a pipe; bubblewrap (or, without it, the bootstrap) loads it after setting
``PR_SET_NO_NEW_PRIVS``. It is a deny list on top of the namespaces: everything Python needs stays
allowed, and each refused call returns an errno (the program sees an ordinary ``OSError``).
"""

from __future__ import annotations

import errno
import os
import subprocess
from functools import lru_cache

# Socket families the design allows: AF_UNIX (multiprocessing, socketpair) and AF_INET/AF_INET6,
# which inside the private network namespace reach only a down loopback. Everything else
# (AF_VSOCK, AF_NETLINK, AF_PACKET, AF_ALG, Bluetooth, ...) is refused.
ALLOWED_SOCKET_FAMILIES = (1, 2, 10)
_MAX_FAMILY = 64

#: Where the program runs inside bubblewrap: a size-limited tmpfs, its only writable place besides /tmp.
WORKDIR = "/program"

# clone() flags that create namespaces (CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET).
_CLONE_NAMESPACE_FLAGS = (0x80, 0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
_KEYCTL_JOIN_SESSION_KEYRING = 1
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C

# Refused outright: namespaces, mounts, tracing, keyrings, kernel/module/time administration, and
# interfaces that bypass or widen the filter (io_uring issues socket calls the filter never sees;
# bpf/perf/userfaultfd are common kernel exploit primitives).
DENIED_SYSCALLS = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "sethostname", "setdomainname", "iopl", "ioperm", "quotactl", "syslog", "vhangup",
    "open_by_handle_at", "name_to_handle_at", "fanotify_init", "lookup_dcookie", "nfsservctl", "quotactl_fd",
    "uselib", "process_madvise", "move_pages", "migrate_pages",
)


@lru_cache(maxsize=1)
def seccomp_bpf() -> tuple[bytes | None, str]:
    """The compiled filter as BPF bytes, or ``(None, why)`` when libseccomp or its bindings are missing."""
    try:
        import pyseccomp as sc
    except ImportError as exc:  # the 'sandbox' extra; without it the filter is off and the sandbox says so
        return None, f"pyseccomp not importable ({exc}): pip install 'lit-memopt[sandbox]'"
    try:
        f = sc.SyscallFilter(defaction=sc.ALLOW)
        deny = sc.ERRNO(errno.EPERM)
        for name in DENIED_SYSCALLS:
            try:
                f.add_rule(deny, name)
            except (RuntimeError, ValueError, OSError):
                pass  # a call this kernel/libseccomp does not know cannot be made either
        for flag in _CLONE_NAMESPACE_FLAGS:
            f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        # clone3 passes its flags in memory the filter cannot read: refused with ENOSYS so that
        # glibc falls back to clone(), whose flags are checked above.
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        refused = sc.ERRNO(errno.EAFNOSUPPORT)
        for call in ("socket", "socketpair"):
            for family in range(_MAX_FAMILY):
                if family not in ALLOWED_SOCKET_FAMILIES:
                    f.add_rule(refused, call, sc.Arg(0, sc.EQ, family))
            f.add_rule(refused, call, sc.Arg(0, sc.GE, _MAX_FAMILY))
        # keyctl: only joining a fresh anonymous session keyring (what the bootstrap does) is allowed.
        f.add_rule(deny, "keyctl", sc.Arg(0, sc.NE, _KEYCTL_JOIN_SESSION_KEYRING))
        f.add_rule(deny, "keyctl", sc.Arg(0, sc.EQ, _KEYCTL_JOIN_SESSION_KEYRING), sc.Arg(1, sc.NE, 0))
        for request in (_TIOCSTI, _TIOCLINUX):
            f.add_rule(deny, "ioctl", sc.Arg(1, sc.EQ, request))
        r, w = os.pipe()
        try:
            with os.fdopen(w, "wb") as out:
                f.export_bpf(out)
            with os.fdopen(r, "rb") as src:
                r = -1
                return src.read(), ""
        finally:
            if r >= 0:
                os.close(r)
    except Exception as exc:  # noqa: BLE001 - libseccomp missing or refusing: reported as "seccomp off"
        return None, f"libseccomp failed: {type(exc).__name__}: {exc}"


# Extension modules whose libraries are not bound (each bind costs every run ~0.1 ms): GUI, terminal and
# database front-ends a generated program has no use for. Importing them fails inside the sandbox.
_NO_LIBRARIES_FOR = ("_tkinter", "_curses", "readline", "nis", "_dbm", "_gdbm")


@lru_cache(maxsize=8)
def interpreter_files(python: str) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """``((host_path, sandbox_path), ...)`` to bind read-only for ``python``, and dirs to hide under them.

    The interpreter, its standard library (with ``site-packages`` covered by an empty tmpfs: no
    third-party or project code is visible), and the shared libraries the interpreter and its
    extension modules load (from ``ldd``), each at the path the loader will look for it.
    """
    query = ("import os, sys, sysconfig\n"
             "print(os.path.realpath(sys.executable))\n"
             "print(os.path.dirname(os.__file__))\n"
             "print(sysconfig.get_path('platstdlib'))\n"
             "print(os.path.dirname(getattr(__import__('_json'), '__file__', '') or '') or '-')\n")
    out = subprocess.run([python, "-I", "-S", "-c", query], capture_output=True, text=True, timeout=60, check=True)
    exe, stdlib, platstdlib, dynload = (line.strip() for line in out.stdout.splitlines()[:4])
    binds: dict[str, str] = {python: os.path.realpath(python), exe: exe}
    roots = sorted({d for d in (stdlib, platstdlib, dynload) if d != "-" and os.path.isdir(d)}, key=len)
    for directory in roots:
        if not any(directory.startswith(r + "/") for r in roots):  # a directory inside another comes with it
            binds[directory] = os.path.realpath(directory)
    elf = [exe]
    if os.path.isdir(dynload):
        elf += [os.path.join(dynload, n) for n in sorted(os.listdir(dynload))
                if n.endswith(".so") and not n.startswith(_NO_LIBRARIES_FOR)]
    for lib in _shared_libraries(elf):
        binds.setdefault(lib, os.path.realpath(lib))
    hidden = tuple(os.path.join(d, sub) for d in {stdlib, platstdlib} for sub in ("site-packages", "dist-packages")
                   if os.path.isdir(os.path.join(d, sub)))
    # Nested paths must be bound after their parents; sorting by path depth gives that order.
    pairs = tuple(sorted(((src, dst) for dst, src in binds.items()), key=lambda p: (p[1].count("/"), p[1])))
    return pairs, hidden


def _shared_libraries(files: list[str]) -> list[str]:
    found: list[str] = []
    for start in range(0, len(files), 64):
        try:
            out = subprocess.run(["ldd", *files[start:start + 64]], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        for line in out.splitlines():
            parts = line.split()
            path = parts[2] if len(parts) >= 3 and parts[1] == "=>" else parts[0] if parts and parts[0].startswith("/") else ""
            if path.startswith("/") and os.path.exists(path) and path not in found:
                found.append(path)
    return found


def bwrap_argv(bwrap: str, python: str, *, uid_drop: bool) -> list[str]:
    """The bubblewrap command line in front of a slot's fork server: the minimal filesystem.

    Read-only everywhere; ``/program``, ``/tmp`` and ``/proc`` are empty directories that each run
    covers with its own tmpfs / procfs in its own mount namespace. The fork server keeps only the
    capabilities it needs to create a run's namespaces and drop to the private uid.
    """
    binds, hidden = interpreter_files(python)
    argv = [bwrap, "--unshare-ipc", "--unshare-uts", "--unshare-net", "--unshare-cgroup-try", "--die-with-parent",
            "--new-session", "--hostname", "sandbox", "--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN"]
    if uid_drop:
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    argv += ["--tmpfs", "/"]
    # bubblewrap creates missing parents 0700: made 0755 first, or the private uid could not reach the files.
    parents = sorted({dst[:i] for _, dst in binds for i in range(1, len(dst)) if dst[i] == "/"} - {"", "/"},
                     key=lambda d: (d.count("/"), d))
    for d in parents + [WORKDIR, "/tmp", "/proc"]:
        argv += ["--perms", "0755", "--dir", d]
    for src, dst in binds:
        argv += ["--ro-bind", src, dst]
    for path in hidden:
        argv += ["--tmpfs", path, "--remount-ro", path]
    argv += ["--dev", "/dev", "--remount-ro", "/", "--chdir", WORKDIR]
    return argv

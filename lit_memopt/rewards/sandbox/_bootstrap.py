"""The script every sandboxed run executes first (``BOOTSTRAP``, with ``CONFIG`` and ``PROGRAM`` as its argv).

Standard library only, and as little of it as possible: with the direct launcher it runs in a new
interpreter per program, so every import is paid thousands of times a step (no ``json``, whose
``re`` import alone costs ~6 ms; ``ctypes`` only for the calls ``os`` lacks, and ``_ctypes`` alone
for the keyring). ``CONFIG`` is ``key=value`` words separated by spaces.

Processes of one run::

    bootstrap (root; forked by the slot's fork server, or a new interpreter: unshares the namespaces)
      ns-init (PID 1 of the run's PID namespace; dies with its parent: PR_SET_PDEATHSIG)
        worker (private uid, rlimits, no_new_privs, seccomp)  -- runs the program

The bootstrap and the init never run generated code. The init reports ``exit signal cpu_s`` on the
status fd, which the worker closes before the program's first line; the worker runs under another
uid and cannot signal, trace or open the files of the processes above it. When the init exits, the
kernel kills everything left in the PID namespace.
"""

from __future__ import annotations

EXIT_MEMORY = 113
EXIT_SETUP_FAILED = 114

BOOTSTRAP = r"""
import os, sys, resource
cfg = dict(w.split("=", 1) for w in sys.argv[1].split())
src = sys.argv[2]
del sys.argv[1:]
sys.argv[0] = "<program>"
probe = cfg["probe"] == "1"
report = []
status_fd = int(cfg["status"])
def fail(what, err):
    if probe:
        report.append("%s=0" % what)
        return
    os.write(2, ("sandbox setup failed at %s: %s\n" % (what, err)).encode())
    os._exit(_SETUP_FAILED_)
import ctypes  # already loaded in a fork server
libc = ctypes.CDLL(None, use_errno=True)
def errno():
    return os.strerror(ctypes.get_errno())
flags = 0
for name, flag in (("net", 0x40000000), ("mount", 0x00020000), ("pid", 0x20000000), ("ipc", 0x08000000),
                   ("uts", 0x04000000)):
    if cfg[name] == "1":
        flags |= flag
if flags and libc.unshare(flags) != 0:
    fail("unshare", errno())
if cfg["mount"] == "1":
    ok = libc.mount(b"none", b"/", None, 16384 | (1 << 18), None) == 0  # MS_REC | MS_PRIVATE
    size = ("size=%s,mode=1777" % cfg["tmpfs_bytes"]).encode()
    ok = ok and libc.mount(b"tmpfs", os.getcwd().encode(), b"tmpfs", 0, size) == 0
    if ok:
        os.chdir(os.getcwd())  # enter the fresh tmpfs that now sits on the working directory
        for shared in (b"/tmp", b"/var/tmp", b"/dev/shm", b"/run/lock"):
            if os.path.isdir(shared) and libc.mount(b"tmpfs", shared, b"tmpfs", 0, b"size=1m,mode=1777") != 0:
                ok = False
    if not ok:
        fail("mount", errno())
alive_r, alive_w = os.pipe()  # at EOF once the bootstrap is gone, whichever namespace the init is in
init = os.fork()
if init:
    # Outside the namespaces: the trainer kills this process on timeout; the init dies with it.
    code = os.waitstatus_to_exitcode(os.waitpid(init, 0)[1])
    os._exit(code if code == _SETUP_FAILED_ else 0)
os.close(alive_w)
libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG = SIGKILL
import select
if select.select([alive_r], [], [], 0)[0]:
    os._exit(0)  # the bootstrap was killed before PDEATHSIG was armed
os.close(alive_r)
if cfg["pid"] == "1" and cfg["mount"] == "1":
    # A /proc of the new PID namespace: the trainer's processes are not even visible.
    if libc.mount(b"proc", b"/proc", b"proc", 2 | 4 | 8, None) != 0:  # nosuid, nodev, noexec
        fail("proc", errno())
if cfg["pid"] != "1":
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come back to us to be reaped
if cfg["keyring"] == "1":
    # A fresh anonymous session keyring: the trainer's keys are no longer "possessed" by anything below.
    serial = libc.syscall(250, 1, None)  # keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)
    if serial < 0:
        fail("keyring", errno())
    report.append("keyring=%d" % serial)
if cfg["seccomp_fd"] != "-":
    # The filter libseccomp compiled in the trainer arrives on an fd (or with the fork server).
    bpf = globals().get("ZYGOTE_BPF")
    if cfg["seccomp_fd"] != "zygote":
        fd = int(cfg["seccomp_fd"])
        chunks = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(fd)
        bpf = b"".join(chunks)
    if not bpf:
        fail("seccomp", "no filter")
    else:
        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
        prog = Prog(len(bpf) // 8, bpf)
        if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:
            fail("seccomp", errno())
if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: setuid binaries gain nothing
    fail("no_new_privs", errno())
worker = os.fork()
if worker == 0:
    if status_fd >= 0:
        os.close(status_fd)
    if cfg["pid"] != "1":
        os.setpgid(0, 0)
    for name in ("CPU", "AS", "FSIZE", "NOFILE", "CORE"):
        value = int(cfg[name])
        hard = value + 1 if name == "CPU" else value
        try:
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, hard))
        except (OSError, ValueError) as err:
            fail("rlimit_" + name, err)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # the run's memory cgroup kills the program first, never the bootstrap
    except OSError:
        pass
    uid = int(cfg["uid"])
    if uid >= 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        except OSError as err:
            fail("uid", err)
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (int(cfg["nproc"]), int(cfg["nproc"])))
        except (OSError, ValueError) as err:
            fail("nproc", err)
    if probe:
        # Observed from inside, not assumed: the trainer compares these with its own view.
        report.append("uid=%d" % os.getuid())
        for ns in ("ipc", "uts", "net", "pid", "mnt"):
            try:
                report.append("ns_%s=%s" % (ns, os.readlink("/proc/self/ns/" + ns)))
            except OSError:
                report.append("ns_%s=?" % ns)
        try:
            for line in open("/proc/self/status"):
                if line.startswith(("NoNewPrivs:", "Seccomp:", "CapEff:")):
                    key, value = line.split(":", 1)
                    report.append("%s=%s" % (key, value.strip()))
            report.append("cgroup=" + ",".join(l.strip().replace(" ", "_") for l in open("/proc/self/cgroup")))
        except OSError as err:
            report.append("proc_error=%s" % type(err).__name__)
        report.append("root=" + ",".join(sorted(os.listdir("/"))))
        try:
            import socket
            socket.socket(16, 2).close()  # AF_NETLINK: always available unless a filter refuses it
            report.append("family_refused=0")
        except OSError:
            report.append("family_refused=1")
        try:
            import colorsys  # rarely preloaded: can this uid still read the standard library?
            report.append("stdlib=1")
        except ImportError:
            report.append("stdlib=0")
        os.write(1, " ".join(report).encode())
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
if cfg["pid"] != "1":
    try:
        os.killpg(worker, 9)
    except OSError:
        pass
if status is not None and status_fd >= 0:
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
    os.write(status_fd, ("%d %d %.6f" % (code, sig, cpu)).encode())
os._exit(0)  # as PID 1 (or its only child) of the namespace: the kernel now kills everything left in it
""".replace("_SETUP_FAILED_", str(EXIT_SETUP_FAILED)).replace("_MEMORY_", str(EXIT_MEMORY))

"""The sandbox against hostile programs, one class of attack per test: the program first, then a check on
the host that nothing was read, left behind or harmed. Every test runs with both launchers (bubblewrap
fork server and the direct fallback); where a feature is reported off, the test checks that the report
says why instead of asserting containment the code does not claim."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import socket
import threading
import time
import uuid

import psutil
import pytest

from lit_memopt.rewards.sandbox import FEATURES, Sandbox, SandboxLimits

pytestmark = pytest.mark.timeout(120)

LIMITS = SandboxLimits(wall_time_s=6.0, cpu_time_s=1.0, memory_mb=256, file_size_mb=1, max_processes=8,
                       max_output_chars=20000)
HERE = os.path.dirname(os.path.abspath(__file__))
_libc = ctypes.CDLL(None, use_errno=True)
_KEY_SPEC_SESSION_KEYRING = -3


@pytest.fixture(scope="module", params=["bwrap", "direct"])
def box(request):
    sandbox = Sandbox(LIMITS, max_workers=2, use_bwrap=request.param == "bwrap")
    if request.param == "bwrap" and sandbox.isolation["launcher"] != "bwrap":
        # Not silently weaker: the probe must say why bubblewrap is not used.
        assert sandbox.isolation["notes"].get("bwrap"), sandbox.isolation
    yield sandbox
    sandbox.close()


def _claims(box: Sandbox, *features: str) -> bool:
    """Whether the sandbox claims every feature; a feature it does not claim must carry its reason."""
    off = [f for f in features if not box.isolation[f]]
    for f in off:
        assert box.isolation["notes"].get(f), f"{f} is off without a reason: {box.isolation}"
    return not off


def _run(box: Sandbox, program: str, **replacements: object):
    for name, value in replacements.items():
        program = program.replace(name, repr(value))
    return box.run(program + f"\n# {uuid.uuid4()}")  # never a cache hit: every test really executes


# ------------------------------------------------------------------ IPC objects
_IPC_CREATE = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shm = libc.shmget(KEY, 4096, 0o1666)
addr = libc.shmat(shm, None, 0)
ctypes.memmove(addr, b"LEAKED-SHM", 10)
msq = libc.msgget(KEY, 0o1666)
mq = libc.mq_open(MQ, os.O_CREAT | os.O_RDWR, 0o666, None)
print("created", shm >= 0, msq >= 0, mq >= 0, flush=True)
time.sleep(SLEEP)
"""
_IPC_READ = """
import ctypes, os, time
time.sleep(DELAY)
libc = ctypes.CDLL(None, use_errno=True)
print("found", libc.shmget(KEY, 0, 0), libc.msgget(KEY, 0), libc.mq_open(MQ, os.O_RDONLY))
"""


def _host_ipc_absent(key: int, mq_name: bytes) -> None:
    for table in ("/proc/sysvipc/shm", "/proc/sysvipc/msg"):
        with open(table) as f:
            keys = {int(line.split()[0]) for line in f.readlines()[1:] if line.strip()}
        assert key not in keys, f"{table} on the host holds the program's key"
    assert _libc.mq_open(mq_name, os.O_RDONLY) == -1 and ctypes.get_errno() == errno.ENOENT


def test_ipc_objects_neither_outlive_the_run_nor_cross_runs(box: Sandbox) -> None:
    key, mq = 0x4C4D0000 + (os.getpid() & 0xFFFF), f"/lit_memopt_{os.getpid()}".encode()
    created = _run(box, _IPC_CREATE, KEY=key, MQ=mq, SLEEP=0.0)
    assert created.stdout.split() == ["created", "True", "True", "True"], created  # IPC works inside a run
    later = _run(box, _IPC_READ, KEY=key, MQ=mq, DELAY=0.0)
    if not _claims(box, "ipc"):
        return
    assert later.stdout.split() == ["found", "-1", "-1", "-1"], later
    # Concurrently, in another pool slot: the creator is still alive while the reader looks.
    both = box.run_many([(_IPC_CREATE.replace("KEY", repr(key + 1)).replace("MQ", repr(mq + b"c"))
                          .replace("SLEEP", "1.5"), ""),
                         (_IPC_READ.replace("KEY", repr(key + 1)).replace("MQ", repr(mq + b"c"))
                          .replace("DELAY", "0.5"), "")])
    assert both[0].stdout.split()[:2] == ["created", "True"], both[0]
    assert both[1].stdout.split() == ["found", "-1", "-1", "-1"], both[1]
    _host_ipc_absent(key, mq)
    _host_ipc_absent(key + 1, mq + b"c")


# ------------------------------------------------------------------ kernel keyrings
@pytest.fixture(scope="module")
def planted_key():
    """A key in a session keyring of this test process (a fresh one: other processes are not touched)."""
    assert _libc.syscall(250, 1, None) > 0  # KEYCTL_JOIN_SESSION_KEYRING (anonymous)
    payload = f"trainer-secret-{uuid.uuid4()}".encode()
    serial = _libc.syscall(248, b"user", b"lit_memopt_secret", payload, len(payload), _KEY_SPEC_SESSION_KEYRING)
    assert serial > 0, os.strerror(ctypes.get_errno())
    return serial, payload


def _session_keys() -> list[int]:
    buf = (ctypes.c_int32 * 64)()
    n = _libc.syscall(250, 11, _KEY_SPEC_SESSION_KEYRING, buf, ctypes.sizeof(buf))  # KEYCTL_READ the keyring
    assert n >= 0
    return list(buf[: n // 4])


def test_trainer_keyring_is_out_of_reach(planted_key) -> None:
    serial, payload = planted_key
    before = _session_keys()
    # Built after the key was planted: its fork servers inherit this session keyring.
    for use_bwrap in (True, False):
        with Sandbox(LIMITS, max_workers=1, use_bwrap=use_bwrap) as box:
            verdict = _run(box, """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(512)
print("session", libc.syscall(250, 0, -3, 0))
print("request", libc.syscall(249, b"user", b"lit_memopt_secret", None, 0))
print("add", libc.syscall(248, b"user", b"planted", b"x", 1, -3))
print("unlink", libc.syscall(250, 9, SERIAL, -3))
print("revoke", libc.syscall(250, 3, SERIAL))
print("read", libc.syscall(250, 11, SERIAL, buf, 512), buf.raw[:80])
try:
    print(open("/proc/keys").read())
except OSError as e:
    print("no /proc/keys", e)
""", SERIAL=serial)
            assert payload.decode() not in verdict.stdout, verdict
            if _claims(box, "keyring", "seccomp"):
                calls = dict(line.split(" ", 1) for line in verdict.stdout.splitlines()[:6])
                assert all(calls[name].split()[0] == "-1" for name in ("session", "request", "add", "unlink", "revoke", "read")), verdict
    # The host: the key is intact, readable, and the keyring holds exactly what it held.
    buf = ctypes.create_string_buffer(512)
    assert _libc.syscall(250, 11, serial, buf, 512) == len(payload) and buf.raw[: len(payload)] == payload
    assert _session_keys() == before == [serial]


# ------------------------------------------------------------------ socket families
def test_non_ip_socket_families_are_refused(box: Sandbox) -> None:
    port = 40000 + os.getpid() % 20000
    program = """
import socket, time
res = {}
for name, fam, typ in (("vsock", 40, 1), ("netlink", 16, 3), ("packet", 17, 3), ("alg", 38, 5), ("bluetooth", 31, 1)):
    try:
        s = socket.socket(fam, typ)
        if fam == 40:
            s.bind((0xFFFFFFFF, PORT))
            s.listen()
        res[name] = "open"
    except OSError as e:
        res[name] = e.errno
a, b = socket.socketpair()          # AF_UNIX: what multiprocessing needs, still allowed
a.send(b"ok")
print(res, b.recv(2), flush=True)
time.sleep(1.5)
"""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(v=_run(box, program, PORT=port)))
    thread.start()
    time.sleep(0.8)
    # While the program is alive, the host can still bind the vsock port it tried to take.
    host_bound = None
    try:
        host = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        host.bind((socket.VMADDR_CID_ANY, port))
        host.close()
        host_bound = True
    except OSError as exc:
        host_bound = exc.errno
    thread.join(30)
    verdict = result["v"]
    assert verdict.status == "ok" and "b'ok'" in verdict.stdout, verdict
    if _claims(box, "seccomp"):
        assert "'open'" not in verdict.stdout, verdict
        assert verdict.stdout.count(str(errno.EAFNOSUPPORT)) == 5, verdict
        assert host_bound is True or host_bound in (errno.EAFNOSUPPORT, errno.ENODEV), host_bound


# ------------------------------------------------------------------ the trainer's files
def test_trainer_files_are_not_readable(box: Sandbox) -> None:
    token = f"trainer-file-{uuid.uuid4()}"
    secret_dir = os.path.join(HERE, f".sandbox_secret_{os.getpid()}")
    os.makedirs(secret_dir, exist_ok=True)
    os.chmod(secret_dir, 0o755)
    secret = os.path.join(secret_dir, "world_readable.txt")
    with open(secret, "w") as f:
        f.write(token)
    os.chmod(secret, 0o644)
    import lit_memopt

    try:
        verdict = _run(box, """
import os
for path in (SECRET, PACKAGE, "/etc/passwd", "/proc/1/environ"):
    try:
        print(path, open(path).read()[:300])
    except OSError as e:
        print(path, "refused", e.errno)
try:
    import lit_memopt
    print("imported lit_memopt")
except ImportError:
    print("no lit_memopt")
print("ROOT", sorted(os.listdir("/")))
""", SECRET=secret, PACKAGE=lit_memopt.__file__)
    finally:
        shutil.rmtree(secret_dir)
    assert verdict.status == "ok", verdict
    assert "imported lit_memopt" not in verdict.stdout
    if _claims(box, "minimal_fs"):
        assert token not in verdict.stdout and "root:x:0" not in verdict.stdout, verdict
        assert "from __future__" not in verdict.stdout
        root = eval(verdict.stdout.split("ROOT", 1)[1])
        assert "work" not in root and "etc" not in root and "home" not in root, root


# ------------------------------------------------------------------ setuid, namespaces, privileged calls
def test_no_new_privileges_namespaces_or_privileged_calls(box: Sandbox, tmp_path) -> None:
    # A setuid-root interpreter on the host tree (seen only where the host tree is visible).
    suid_dir = os.path.join(HERE, f".sandbox_suid_{os.getpid()}")
    os.makedirs(suid_dir, exist_ok=True)
    os.chmod(suid_dir, 0o755)
    suid = os.path.join(suid_dir, "python-suid")
    shutil.copy2("/usr/bin/python3.11" if os.path.exists("/usr/bin/python3.11") else box.isolation["python"], suid)
    os.chown(suid, 0, 0)
    os.chmod(suid, 0o4755)
    try:
        verdict = _run(box, """
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("nnp", status["NoNewPrivs"].strip(), "capeff", status["CapEff"].strip(), "uid", os.getuid())
print("unshare_user", libc.unshare(0x10000000))
print("unshare_net", libc.unshare(0x40000000))
pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)
if pid == 0:
    os._exit(0)
print("clone_newuser", pid)
print("mount", libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None))
print("ptrace", libc.ptrace(16, 1, 0, 0))
try:
    out = subprocess.run([SUID, "-S", "-c", "import os; print(os.geteuid())"], capture_output=True, text=True)
    print("suid euid", out.stdout.strip() or out.stderr.strip()[-80:])
except OSError as e:
    print("suid refused", e.errno)
""", SUID=suid)
    finally:
        shutil.rmtree(suid_dir)
    assert verdict.status == "ok", verdict
    lines = dict(line.split(" ", 1) for line in verdict.stdout.splitlines())
    if _claims(box, "no_new_privs"):
        assert lines["nnp"].split()[0] == "1", verdict
        assert lines.get("suid euid", "refused") != "0", verdict  # the setuid bit gave nothing
    if _claims(box, "uid"):
        assert lines["nnp"].split()[2] == "0000000000000000" and lines["nnp"].split()[4] != "0", verdict
    if _claims(box, "seccomp"):
        for call in ("unshare_user", "unshare_net", "clone_newuser", "mount", "ptrace"):
            assert lines[call] == "-1", (call, verdict)


# ------------------------------------------------------------------ limits per run, not per process
def test_memory_is_limited_per_run(box: Sandbox) -> None:
    # Three children of 180 MiB each: every one is under the 256 MiB per-process limit, the run is not.
    # (A CPU limit that reclaim under memory pressure cannot reach on a busy machine.)
    box = Sandbox(SandboxLimits(wall_time_s=20.0, cpu_time_s=10.0, memory_mb=256), max_workers=1,
                  use_bwrap=box.isolation["launcher"] == "bwrap")
    verdict = _run(box, """
import os, time
kids = []
for i in range(3):
    pid = os.fork()
    if pid == 0:
        data = b"x" * (180 << 20)
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
print("children", [os.waitpid(p, 0)[1] for p in kids])
""")
    assert psutil.Process().is_running()
    if _claims(box, "cgroup_memory"):
        assert verdict.status == "memory" and "all processes" in verdict.detail, verdict
        assert box._groups[0].peak_memory_bytes() <= (LIMITS.memory_mb << 20) + (48 << 20)
    box.close()


def test_cpu_time_is_limited_per_run(box: Sandbox) -> None:
    # Three spinners: each under the 1 s per-process CPU limit for a while, together past it.
    start = time.monotonic()
    cpu_before = [g.counters()[0] for g in box._groups]
    verdict = _run(box, """
import os
for i in range(2):
    if os.fork() == 0:
        break
while True:
    pass
""")
    wall = time.monotonic() - start
    assert verdict.status == "timeout", verdict
    if _claims(box, "cgroup_cpu"):
        assert "all processes" in verdict.detail and wall < LIMITS.wall_time_s, (verdict, wall)
        used = sum(g.counters()[0] for g in box._groups) - sum(cpu_before)
        assert used < LIMITS.cpu_time_s + 0.5, used


def test_processes_are_limited_per_run(box: Sandbox) -> None:
    verdict = _run(box, """
import os, time
made = 0
for i in range(30):
    try:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        made += 1
    except OSError:
        break
print("forked", made)
""")
    made = int(verdict.stdout.split()[1])
    if _claims(box, "cgroup_pids") or _claims(box, "nproc"):
        assert made < LIMITS.max_processes, verdict


# ------------------------------------------------------------------ every input gets a verdict
def test_invalid_input_never_raises(box: Sandbox) -> None:
    good = "print(input()[::-1])"
    jobs = [(good, "abc", "cba"), ("print('\ud800')", ""), (good, "x\udfffy"), (None, ""), (b"print(1)", ""),
            (5, ""), ("print(1)", 7), ("x" * 200_000, ""), ("print(1)\x00", ""), "not a tuple", ("print(2)",),
            (good, "abc", object()), (good, "abc", "cba")]
    verdicts = box.run_many(jobs)
    assert len(verdicts) == len(jobs)
    assert [v.status for v in verdicts] == ["ok", "error", "error", "error", "error", "error", "error", "error",
                                            "error", "error", "ok", "wrong", "ok"], verdicts
    assert "invalid input" in verdicts[1].detail and "surrogate" in verdicts[1].detail
    assert "stdin" in verdicts[2].detail and "program must be str" in verdicts[3].detail
    class BadRepr:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    assert box.run_many([(BadRepr(), ""), ("print(1)", BadRepr())])[1].status == "error"
    assert box.run("print('\udc80')").status == "error"
    assert box.run(None).status == "error"  # type: ignore[arg-type]


def test_cache_is_bounded_by_bytes() -> None:
    box = Sandbox(SandboxLimits(max_output_chars=50_000), max_workers=1, cache_bytes=600_000)
    try:
        for i in range(6):
            box.run(f"print('{i}' * 40000)")
            assert box.cache_nbytes <= 600_000
        assert len(box._cache) < 6  # older entries were evicted for bytes, not entries
        assert box.run("print('5' * 40000)").cached and not box.run("print('0' * 40000)").cached
        huge = box.run("print('h' * 49000)\nprint('i' * 49000)")
        assert huge.status == "ok" and box.cache_nbytes <= 600_000
    finally:
        box.close()


# ------------------------------------------------------------------ the probe is honest
def test_probe_report_matches_what_a_run_sees(box: Sandbox) -> None:
    iso = box.isolation
    verdict = _run(box, """
import os
print("NS", *(os.readlink("/proc/self/ns/" + n) for n in ("ipc", "uts", "net", "pid", "mnt")))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("ST", status["NoNewPrivs"].strip(), status["Seccomp"].strip(), os.getuid())
print("ROOT", " ".join(sorted(os.listdir("/"))))
""")
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in verdict.stdout.splitlines()}
    theirs = lines["NS"].split()
    for name, seen in zip(("ipc", "uts", "net", "pid", "mount"), theirs):
        ns = "mnt" if name == "mount" else name
        assert iso[name] == (seen != os.readlink(f"/proc/self/ns/{ns}")), (name, iso)
    nnp, seccomp, uid = lines["ST"].split()
    assert iso["no_new_privs"] == (nnp == "1") and iso["seccomp"] == (seccomp == "2")
    assert iso["uid"] == (uid != str(os.getuid()))
    root = set(lines["ROOT"].split())
    assert iso["minimal_fs"] == (not {"etc", "home", "usr", "var"} & root) or not iso["minimal_fs"] and "etc" in root
    # require: a feature that is off refuses to build the sandbox, naming it; one that is on does not.
    off = [f for f in FEATURES if not iso[f]]
    use_bwrap = iso["launcher"] == "bwrap"
    if off:
        with pytest.raises(RuntimeError, match=off[0]):
            Sandbox(LIMITS, max_workers=1, use_bwrap=use_bwrap, require=off[:1])
    else:
        Sandbox(LIMITS, max_workers=1, use_bwrap=use_bwrap, require="all").close()
    with pytest.raises(ValueError, match="require"):
        Sandbox(LIMITS, max_workers=1, require=["teleportation"])


def test_no_leftovers_after_hostile_runs(box: Sandbox) -> None:
    """After everything above: no process of a slot uid is alive, and the slot cgroups hold only the fork servers."""
    from lit_memopt.rewards.sandbox import _child_uid

    uids = {_child_uid(slot) for slot in range(box.max_workers)}
    deadline = time.monotonic() + 3.0
    while True:
        stray = [p for p in psutil.process_iter(["uids", "status"])
                 if p.info["uids"] and p.info["uids"].real in uids and p.info["status"] != psutil.STATUS_ZOMBIE]
        resident = sum(len(open(os.path.join(d, "cgroup.procs")).read().split())
                       for g in box._groups for d in list(g.dirs.values())[:1])
        if (not stray and resident <= 2 * len(box._zygotes)) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stray == [] and resident <= 2 * len(box._zygotes), (stray, resident)


def test_fork_server_death_and_copies_do_not_break_runs() -> None:
    """A dead fork server costs at most the run it was serving; a deep copy (Lightning may make one) runs too."""
    import copy

    box = Sandbox(LIMITS, max_workers=1)
    try:
        assert box.run("print(1)", expected="1").ok
        if not box._zygotes:
            assert box.isolation["launcher"] == "direct" and box.isolation["notes"].get("bwrap")
            return
        server = box._zygotes[0]._proc
        for child in psutil.Process(server.pid).children(recursive=True):
            child.kill()
        server.wait(10)
        verdicts = [box.run(f"print({i})") for i in range(3)]
        assert verdicts[-1].ok and all(v.status in ("ok", "error") for v in verdicts), verdicts
        twin = copy.deepcopy(box)
        try:
            assert twin.run("print(2 + 2)", expected="4").ok and twin.isolation == box.isolation
        finally:
            twin.close()
    finally:
        dirs = [d for g in box._groups for d in g.dirs.values()]
        box.close()
    assert not [d for d in dirs if os.path.exists(d)], "close() left slot cgroups behind"


def test_bubblewrap_failing_here_falls_back_and_says_why(monkeypatch) -> None:
    """bubblewrap installed but refused by the machine: the direct launcher is used and the report says so."""
    from lit_memopt.rewards.sandbox import probe

    python = None
    monkeypatch.setattr(probe, "bwrap_argv", lambda *a, **k: ["/bin/sh", "-c", "echo 'bwrap: refused here' >&2; exit 1"])
    monkeypatch.setattr(probe, "find_bwrap", lambda: "/usr/bin/bwrap")
    lock, cache = probe.probe_cache()
    saved = dict(cache)
    cache.clear()
    try:
        box = Sandbox(LIMITS, max_workers=1, python=python)
        try:
            assert box.isolation["launcher"] == "direct" and not box.isolation["bwrap"]
            assert "failed here" in box.isolation["notes"]["bwrap"]
            assert box.isolation["uid"] and box.isolation["seccomp"] and box.isolation["ipc"], box.isolation
            assert box.run("print(6 * 7)", expected="42").ok
        finally:
            box.close()
        with pytest.raises(RuntimeError, match="bwrap"):
            Sandbox(LIMITS, max_workers=1, python=python, require=["bwrap"])
    finally:
        cache.clear()
        cache.update(saved)


def test_one_line_report_names_every_feature(box: Sandbox) -> None:
    from lit_memopt.rewards.sandbox.probe import summary_line

    line = summary_line(box.isolation)
    assert "\n" not in line
    on_part, _, rest = line.partition("; OFF: ")
    for feature in FEATURES:
        assert (feature in on_part.split("on: ", 1)[1].split(", ")) == bool(box.isolation[feature]), (feature, line)
        if not box.isolation[feature]:
            assert f"{feature} ({box.isolation['notes'][feature]}" in rest, (feature, line)
    if not box.isolation["cgroup_memory"]:
        assert "limited per process only: memory" in line

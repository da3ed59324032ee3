"""The code sandbox: verdicts, the cache, and hostile programs that must never hurt the trainer."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import psutil
import pytest

from lit_memopt.rewards.sandbox import VERDICTS, Sandbox, SandboxLimits, _child_uid

pytestmark = pytest.mark.timeout(90)

SECRET_NAME = "LIT_MEMOPT_TEST_SECRET"
SECRET_VALUE = "hunter2-do-not-leak"


# Children the test process already had before this module (e.g. multiprocessing's resource
# tracker started by an earlier test) are not the sandbox's doing.
_PREEXISTING: set[int] = set()


@pytest.fixture(scope="module")
def sandbox():
    _PREEXISTING.update(p.pid for p in psutil.Process().children(recursive=True))
    box = Sandbox(SandboxLimits(wall_time_s=2.0, cpu_time_s=1.0, memory_mb=256, file_size_mb=1,
                                max_processes=8, max_output_chars=2000), max_workers=4)
    yield box
    box.close()


def _fork_servers(box: Sandbox) -> set[int]:
    """The slots' fork servers (bubblewrap and the zygote under it): resident by design, never a run's leftover."""
    pids = set()
    for zygote in getattr(box, "_zygotes", []):
        proc = zygote._proc
        if proc is not None and proc.poll() is None:
            pids.add(proc.pid)
            if psutil.Process(proc.pid).name() == "bwrap":  # the server itself runs under bubblewrap
                pids.update(c.pid for c in psutil.Process(proc.pid).children())
    return pids


def _sandbox_processes(box: Sandbox) -> list[psutil.Process]:
    """Live processes this test could have left: children of the test process, or owned by a slot uid."""
    servers = _fork_servers(box)
    left = [p for p in psutil.Process().children(recursive=True)
            if p.pid not in _PREEXISTING and p.pid not in servers and _alive(p)]
    if box.isolation["uid"]:
        uids = {_child_uid(slot) for slot in range(box.max_workers)}
        for proc in psutil.process_iter(["uids"]):
            try:
                if proc.info["uids"] and proc.info["uids"].real in uids and _alive(proc):
                    left.append(proc)
            except psutil.Error:
                pass
    return left


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _assert_nothing_left(box: Sandbox) -> None:
    deadline = time.monotonic() + 2.0  # the kernel may need a moment to tear down killed tasks
    while _sandbox_processes(box) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes(box) == []


def test_ok_wrong_error_and_stdin(sandbox: Sandbox) -> None:
    assert sandbox.run("print(sum(map(int, input().split())))", "2 40", expected="42").status == "ok"
    wrong = sandbox.run("print(sum(map(int, input().split())))", "2 41", expected="42")
    assert wrong.status == "wrong" and wrong.stdout.strip() == "43"
    err = sandbox.run("def f(:\n  pass")
    assert err.status == "error" and "SyntaxError" in err.detail
    assert sandbox.run("raise SystemExit(3)").status == "error"
    # The standard library is importable after the privilege drop.
    assert sandbox.run("import collections, heapq, re, math\nprint(math.gcd(12, 18))", expected="6").ok
    _assert_nothing_left(sandbox)


def test_cache_runs_identical_pairs_once(sandbox: Sandbox) -> None:
    sandbox.reset_stats()
    program = "import random\nprint(random.random())"  # different output on every real execution
    first = sandbox.run(program, "a")
    again = sandbox.run(program, "a")
    other_input = sandbox.run(program, "b")
    assert not first.cached and again.cached and not other_input.cached
    assert again.stdout == first.stdout and other_input.stdout != first.stdout
    # The cache is keyed by (program, stdin) only; the expected output is judged afterwards.
    assert sandbox.run(program, "a", expected=first.stdout).status == "ok"
    assert sandbox.run(program, "a", expected="nope").status == "wrong"
    assert sandbox.cache_hit_rate == pytest.approx(3 / 5)
    batch = sandbox.run_many([("print(1)", ""), ("print(2)", ""), ("print(1)", "", "1"), ("print(2)", "", "3")])
    assert [v.status for v in batch] == ["ok", "ok", "ok", "wrong"]
    assert [v.cached for v in batch] == [False, False, True, True]
    assert sandbox.cache_hit_rate == pytest.approx(5 / 9)
    counts = sandbox.verdict_counts
    assert set(counts) == set(VERDICTS) and counts["wrong"] == 2 and sum(counts.values()) == 9


def test_parallel_pool_is_faster_than_serial(sandbox: Sandbox) -> None:
    # Four sleepers of 0.6 s each in a pool of 4 finish well under their serial 2.4 s.
    start = time.monotonic()
    verdicts = sandbox.run_many([(f"import time\ntime.sleep(0.6)\nprint({i})", "") for i in range(4)])
    assert [v.stdout.strip() for v in verdicts] == ["0", "1", "2", "3"]
    assert time.monotonic() - start < 2.2
    _assert_nothing_left(sandbox)


def test_infinite_loop_times_out(sandbox: Sandbox) -> None:
    verdict = sandbox.run("while True:\n    pass")
    assert verdict.status == "timeout"
    sleeper = sandbox.run("import time\ntime.sleep(30)")  # no CPU used: only the wall clock catches it
    assert sleeper.status == "timeout" and "wall" in sleeper.detail
    _assert_nothing_left(sandbox)


def test_memory_bomb(sandbox: Sandbox) -> None:
    verdict = sandbox.run("x = bytearray(4 * 1024 ** 3)\nprint(len(x))")
    assert verdict.status == "memory"
    # bytes(n) is calloc'ed: address space grows without touching pages, so this is fast even on a busy host.
    growing = sandbox.run("chunks = []\nwhile True:\n    chunks.append(bytes(64 * 1024 ** 2))")
    assert growing.status == "memory"
    _assert_nothing_left(sandbox)


def test_fork_bomb_and_setsid_escape(sandbox: Sandbox) -> None:
    bomb = sandbox.run("import os\nwhile True:\n    os.fork()")
    assert bomb.status in ("error", "timeout")
    if sandbox.isolation["nproc"]:
        assert "Resource temporarily unavailable" in bomb.stderr or bomb.status == "timeout"
    # A grandchild that leaves the process group and outlives its parent is still killed.
    escape = sandbox.run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')")
    assert escape.status == "ok"
    assert sandbox.isolation["uid"], "only a private uid reaches children that called setsid()"
    _assert_nothing_left(sandbox)


def test_huge_output_is_cut(sandbox: Sandbox) -> None:
    verdict = sandbox.run("while True:\n    print('x' * 100000)")
    assert verdict.status == "error" and "output" in verdict.detail
    assert len(verdict.stdout) <= sandbox.limits.max_output_chars
    _assert_nothing_left(sandbox)


def test_cannot_write_outside_working_dir(sandbox: Sandbox, tmp_path) -> None:
    # A trainer-owned directory on the real filesystem (not under /tmp, which the sandbox hides).
    trainer_dir = tempfile.mkdtemp(prefix=".sandbox_test_", dir=os.path.dirname(os.path.abspath(__file__)))
    os.chmod(trainer_dir, 0o755)
    try:
        for target in (os.path.join(trainer_dir, "escaped.txt"), str(tmp_path / "escaped.txt")):
            verdict = sandbox.run(f"open({target!r}, 'w').write('pwned')")
            assert verdict.status == "error" and ("Permission" in verdict.detail or "No such file" in verdict.detail)
            assert not os.path.exists(target)
        up = sandbox.run("open('../escaped.txt', 'w').write('pwned')")
        assert up.status == "error"
        # Its own working directory is writable; /tmp is a private tmpfs, discarded after the run.
        shared = f"/tmp/lit_memopt_escape_{os.getpid()}"
        ok = sandbox.run(f"open('mine.txt', 'w').write('fine')\nopen({shared!r}, 'w').write('x')\nprint('done')",
                         expected="done")
        assert ok.status == "ok"
        if sandbox.isolation["mount"]:
            assert not os.path.exists(shared)
    finally:
        shutil.rmtree(trainer_dir)
    _assert_nothing_left(sandbox)


def test_trainer_environment_is_not_visible(sandbox: Sandbox, monkeypatch) -> None:
    monkeypatch.setenv(SECRET_NAME, SECRET_VALUE)
    verdict = sandbox.run(f"import os\nprint(os.environ.get({SECRET_NAME!r}))\nprint(sorted(os.environ))")
    assert verdict.status == "ok" and SECRET_VALUE not in verdict.stdout
    assert verdict.stdout.splitlines()[0] == "None"
    # Nor through /proc of the trainer.
    snoop = sandbox.run("import os\nprint(open('/proc/%d/environ' % os.getppid(), 'rb').read())")
    assert SECRET_VALUE not in snoop.stdout
    if sandbox.isolation["uid"]:
        assert snoop.status == "error"


def test_no_network(sandbox: Sandbox) -> None:
    verdict = sandbox.run("import socket\ns = socket.create_connection(('1.1.1.1', 53), timeout=1)\nprint('connected')")
    if not sandbox.isolation["net"]:
        pytest.skip("this platform does not permit a private network namespace (the sandbox warns about it)")
    assert verdict.status == "error" and "connected" not in verdict.stdout
    _assert_nothing_left(sandbox)


def test_cannot_kill_the_trainer(sandbox: Sandbox) -> None:
    for program in ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
                    "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('alive')",
                    "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)"):
        verdict = sandbox.run(program)
        assert verdict.status == "error", verdict  # refused, or the program killed only itself
    assert psutil.Process().is_running()  # the trainer is this test process: still here
    _assert_nothing_left(sandbox)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_workers"):
        Sandbox(max_workers=0)
    with pytest.raises(ValueError, match="wall_time_s"):
        SandboxLimits(wall_time_s=0)
    box = Sandbox(max_workers=1)
    assert box.run("x" * 200_000).status == "error"
    box.close()

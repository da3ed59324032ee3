"""A CRSP training step whose proposer writes only hostile programs: the step completes, every program gets
a verdict, and the host is left as it was (no process, IPC object or key behind, trainer files unread)."""

from __future__ import annotations

import ctypes
import os
import time
import uuid

import psutil
import pytest
from test_crsp import _module, _trainer

from lit_memopt.data.code_tasks import CodeTaskDataModule
from lit_memopt.rewards.sandbox import _child_uid

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

_IPC_KEY = 0x4C4E0000 + (os.getpid() & 0xFFFF)


def _hostile_proposals(secret_path: str) -> list[str]:
    body = [
        "import os\nwhile True:\n    os.fork()",                                   # fork bomb
        "x = b'x' * (10 ** 10)",                                                     # memory bomb
        "import os\nkids = [os.fork() for _ in range(3)]\ndata = b'y' * (200 << 20)",  # memory across processes
        "while True:\n    pass",                                                     # CPU
        "print('z' * 10 ** 7)",                                                      # output flood
        "s = '\\ud800'",                                                             # placeholder, see below
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)",
        f"import ctypes\nlibc = ctypes.CDLL(None)\nlibc.shmget({_IPC_KEY}, 4096, 0o1666)\nlibc.msgget({_IPC_KEY}, 0o1666)",
        "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.syscall(248, b'user', b'planted', b'x', 1, -3)",
        f"print(open({secret_path!r}).read())",
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)",  # daemon
        "import socket\nsocket.socket(40, 1).bind((0xFFFFFFFF, 41234))",            # vsock
    ]
    texts = [f"```python\n{b}\ndef f(x):\n    return x\n```\nInput: 3\n" for b in body]
    texts[5] = "```python\ndef f(x):\n    return '\ud800' + str(x)\n```\nInput: 3\n"  # a lone surrogate in the program
    return texts


def test_crsp_step_survives_hostile_proposals(monkeypatch, tmp_path) -> None:
    token = f"trainer-secret-{uuid.uuid4()}"
    secret = tmp_path / "secret.txt"
    secret.write_text(token)
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)
    proposals = _hostile_proposals(str(secret))
    module = _module(roles={"function_task_ratio": 0.0, "num_solver_samples": 1, "critiques_per_task": 1},
                     generation={"max_new_tokens": {"propose": 4, "solve": 4, "critique": 4}},
                     sandbox={"wall_time_s": 4.0, "cpu_time_s": 1.0, "memory_mb": 256})
    original = module._generate
    seen_outputs: list[str] = []

    def scripted(role, prompts, num_samples, max_new_tokens, stream=""):
        rollout, texts = original(role, prompts, num_samples, max_new_tokens)
        if role == "propose":
            return rollout, [proposals[i % len(proposals)] for i in range(len(texts))]
        return rollout, texts

    monkeypatch.setattr(module, "_generate", scripted)
    trainer = _trainer(1)
    start = time.monotonic()
    trainer.fit(module, datamodule=CodeTaskDataModule(module.tokenizer, batch_size=len(proposals)))
    assert trainer.global_step == 1 and psutil.Process().is_running()
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["train/proposal_valid_rate"] < 0.5
    bad = sum(metrics[f"train/sandbox_{v}"] for v in ("error", "timeout", "memory"))
    assert bad >= len(proposals) - 3, metrics
    box = module.sandbox
    # Nothing read: the sandbox's cached outputs never hold the trainer's secret.
    for verdict in box._cache.values():
        seen_outputs.append(verdict.stdout + verdict.stderr)
    if box.isolation["minimal_fs"]:
        assert not any(token in out for out in seen_outputs)
    # Nothing left behind on the host: IPC objects, keys in this process's session keyring, processes.
    if box.isolation["ipc"]:
        for table in ("/proc/sysvipc/shm", "/proc/sysvipc/msg"):
            with open(table) as f:
                assert str(_IPC_KEY) not in {line.split()[0] for line in f.readlines()[1:] if line.strip()}
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(250, 10, -3, b"user", b"planted", 0) == -1  # KEYCTL_SEARCH the session keyring: absent
    uids = {_child_uid(slot) for slot in range(box.max_workers)}
    deadline = time.monotonic() + 3.0
    while True:
        stray = [p for p in psutil.process_iter(["uids", "status"])
                 if p.info["uids"] and p.info["uids"].real in uids and p.info["status"] != psutil.STATUS_ZOMBIE]
        if not stray or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stray == []
    assert time.monotonic() - start < 300


def test_crsp_passes_the_sandbox_requirement_on() -> None:
    with pytest.raises(ValueError, match="require"):
        _module(sandbox={"require": ["teleportation"]}).setup("test")
    module = _module(sandbox={"require": ["rlimits"]})
    module.setup("test")
    try:
        assert module.sandbox.require == ("rlimits",)
    finally:
        module.sandbox.close()

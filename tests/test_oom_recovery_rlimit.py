"""OOMRecovery recovers from a *real* allocator failure: a subprocess whose address space is capped
(RLIMIT_AS) so that the whole batch cannot be allocated but half of it can."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

resource = pytest.importorskip("resource")  # POSIX only: the limit is what produces the failure

SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset
    from lit_memopt.callbacks import OOMRecovery

    torch.set_num_threads(1)
    BATCH, WIDTH, HIDDEN = 256, 16, 32768
    ACT = BATCH * HIDDEN * 4  # bytes of one [BATCH, HIDDEN] fp32 activation (32 MiB)

    class Wide(LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.up = torch.nn.Linear(WIDTH, HIDDEN)
            self.down = torch.nn.Linear(HIDDEN, WIDTH)
        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.down(torch.nn.functional.gelu(self.up(x))) - y) ** 2).mean()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    def vm_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    class CapAddressSpace(Callback):
        # After one full-batch step (threads, allocator arenas warmed up), cap the address space so that a
        # full batch (about 3.4 x ACT of address space, measured) no longer fits but half a batch does.
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:
                limit = vm_bytes() + 5 * ACT // 2
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4 * BATCH, WIDTH, generator=g), torch.randn(4 * BATCH, WIDTH, generator=g))
    recovery = OOMRecovery(grow_after_steps=None)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[recovery, CapAddressSpace()])
    trainer.fit(Wide(), DataLoader(data, batch_size=BATCH))
    json.dump({"steps": trainer.global_step, "events": recovery.events, "size": recovery.micro_batch_size}, sys.stdout)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_real_cpu_allocator_failure_is_recovered(tmp_path: Path) -> None:
    script = tmp_path / "capped.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    # Large blocks always mmap'd (and unmapped when freed): the address space then follows live memory.
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["steps"] == 3
    assert result["events"], "the address-space cap produced no OOM: the test did not test anything"
    # The error came from the real CPU allocator, not from the simulator.
    assert all("DefaultCPUAllocator" in e["message"] for e in result["events"]), result["events"]
    assert result["size"] < 256

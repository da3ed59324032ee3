"""OOMRecovery under 2-process DDP (gloo, CPU): an OOM on one rank only, in forward and in backward,
neither hangs nor desynchronises; both ranks end with the weights of the OOM-free DDP run. A non-OOM
error on one rank stops every rank instead of leaving the others waiting in a collective."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from _ranks import free_port, run_ranks

WORLD = 2


def _worker(rank: int, port: int, out_dir: str, tests_dir: str) -> None:
    # Lightning sees LOCAL_RANK and treats the processes as launched externally (no re-launch).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))
    sys.path.insert(0, tests_dir)
    torch.set_num_threads(1)
    import test_oom_recovery as helpers
    from lightning.pytorch.strategies import DDPStrategy

    from lit_memopt.callbacks import OOMRecovery

    def run(module, callbacks):  # noqa: ANN001, ANN202
        strategy = DDPStrategy(process_group_backend="gloo")
        helpers.fit(module, callbacks, devices=WORLD, strategy=strategy, max_steps=4)
        return helpers.weights(module)

    reference = run(helpers.PlannedOOMModule(optimizer="adam"), [])
    # Only rank 1 runs out of memory: in forward at batch 1, mid-backward at batch 2 and 3.
    plan = {(1, 0, 1): ("forward", 4), (1, 0, 2): ("backward", 3), (1, 0, 3): ("backward", 1)}
    module = helpers.PlannedOOMModule(plan=plan, optimizer="adam")
    recovery = OOMRecovery(grow_after_steps=None)
    recovered = run(module, [recovery])
    result = {"reference": reference, "recovered": recovered, "events": recovery.events, "history": recovery.history,
              "micro_sizes": module.seen_micro_sizes}

    class FailsOnRank1(helpers.PlannedOOMModule):
        """A bug (not an OOM) on one rank only: every rank must stop, none may wait forever."""

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            if self.global_rank == 1 and batch_idx == 1:
                raise ValueError("broken batch on rank 1")
            return super().training_step(batch, batch_idx)

    try:
        run(FailsOnRank1(optimizer="adam"), [OOMRecovery()])
        result["failure"] = "no error"
    except Exception as e:  # noqa: BLE001 - the error is the result
        result["failure"] = f"{type(e).__name__}: {e}"
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_oom_on_one_rank_keeps_ranks_in_step(tmp_path: Path) -> None:
    tests_dir = str(Path(__file__).parent)
    failure = run_ranks(_worker, (free_port(), str(tmp_path), tests_dir), nprocs=WORLD, timeout_s=200)
    assert failure is None, failure
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    r0, r1 = results
    # Decisions were taken together: both ranks saw the same events and size changes...
    def without_message(events: list[dict]) -> list[dict]:
        return [{k: v for k, v in e.items() if k != "message"} for e in events]

    assert without_message(r0["events"]) == without_message(r1["events"]) and r0["history"] == r1["history"]
    assert [e["phase"] for e in r0["events"]] == ["forward", "backward", "backward"]
    assert [h["to"] for h in r0["history"]] == [4, 2, 1]
    # ...where only rank 1 ran out of memory; rank 0 followed the agreement.
    assert all(e["message"] == "OOM on another rank" for e in r0["events"])
    assert all("CUDA out of memory" in e["message"] for e in r1["events"])
    # Both ranks ran the same micro-batch sizes (no rank skipped or repeated a collective).
    assert r0["micro_sizes"] == r1["micro_sizes"]
    # A non-OOM error on one rank stops both ranks: the failing one with its error, the other told why.
    assert r1["failure"] == "ValueError: broken batch on rank 1"
    assert r0["failure"].startswith("OOMRecoveryError: OOMRecovery: another rank failed"), r0["failure"]
    # Identical weights on both ranks, equal to the OOM-free DDP run.
    for key in r0["recovered"]:
        assert torch.equal(r0["recovered"][key], r1["recovered"][key]), key
        torch.testing.assert_close(r0["recovered"][key], r0["reference"][key], atol=1e-6, rtol=1e-5)

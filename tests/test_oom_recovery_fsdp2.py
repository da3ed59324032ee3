"""OOMRecovery under FSDP2 (Lightning's ModelParallelStrategy, ``fully_shard``; gloo, 2 CPU processes).

An out-of-memory error on one rank only — in forward, in backward, and in the backward of the last
micro-batch of a step — with ``accumulate_grad_batches`` 1 and 2, on an MLP and on a tiny
transformers Qwen3: no hang, both ranks take the same decisions, and the final weights equal the run
without OOMRecovery (float64, SGD, 1e-12). A negative control with the collective guards switched
off hangs or aborts: the guards are what keeps the ranks in step.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from test_oom_recovery import _OOMInBackward  # the OOM in the middle of backward (memory_budget)
from _ranks import free_port, run_ranks

WORLD = 2
DIM, HIDDEN, N_SAMPLES, BATCH = 6, 16, 64, 8
VOCAB, SEQ = 64, 8


def _build_module(kind: str, plan: dict, accumulate: int):  # noqa: ANN202 - classes live in the worker (spawn)
    """A LightningModule that builds and shards its model in configure_model, with planned OOMs.

    ``plan[(rank, batch_idx)] = (phase, rule, value)``: rule ``"size"`` fails every micro-batch larger
    than ``value``; rule ``"call"`` fails once, on the ``value``-th call of that batch (0-based),
    which is how the last micro-batch of a step is hit.
    """
    from lightning.pytorch import LightningModule
    from torch.distributed.fsdp import fully_shard

    from lit_memopt.memory import memory_budget

    class Sharded(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.calls: dict[int, int] = defaultdict(int)
            self.seen_micro_sizes: list[int] = []
            self.fired: set = set()
            torch.manual_seed(0)
            if kind == "mlp":
                self.model = torch.nn.Sequential(
                    torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                    torch.nn.Linear(HIDDEN, DIM),
                ).double()
                self.blocks = [self.model[0], self.model[2], self.model[4]]
            else:
                from transformers import Qwen3Config, Qwen3ForCausalLM

                config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
                self.model = Qwen3ForCausalLM(config).double()
                self.blocks = list(self.model.model.layers)
            self._probe = self.blocks[1]
            self._probe.register_forward_pre_hook(self._maybe_oom_forward)
            self._probe.register_forward_hook(self._maybe_oom_backward)
            self._micro: tuple[int, int] = (0, 0)

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def _rule(self) -> tuple[str, str, int] | None:
            return plan.get((self.global_rank, self._micro[0]))

        def _fails(self, phase: str) -> bool:
            rule = self._rule()
            if rule is None or rule[0] != phase:
                return False
            batch_idx, call = self._micro
            if rule[1] == "size":
                return self._micro_size > rule[2]
            key = (self.current_epoch, batch_idx)
            if call == rule[2] and key not in self.fired:
                self.fired.add(key)
                return True
            return False

        def _maybe_oom_forward(self, module: Any, args: Any) -> None:
            if self._fails("forward"):
                with memory_budget(0):
                    torch.empty(1024)

        def _maybe_oom_backward(self, module: Any, args: Any, output: Any) -> Any:
            if not self._fails("backward"):
                return None
            if isinstance(output, tuple):
                return (_OOMInBackward.apply(output[0]), *output[1:])
            return _OOMInBackward.apply(output)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self._micro = (batch_idx, self.calls[batch_idx])
            self.calls[batch_idx] += 1
            if kind == "mlp":
                x, y = batch
                self._micro_size = x.shape[0]
                self.seen_micro_sizes.append(self._micro_size)
                loss = ((self.model(x) - y) ** 2).mean()
            else:
                (ids,) = batch
                self._micro_size = ids.shape[0]
                self.seen_micro_sizes.append(self._micro_size)
                loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Sharded()


def _data(kind: str):  # noqa: ANN202
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return TensorDataset(torch.randn(N_SAMPLES, DIM, generator=g, dtype=torch.float64),
                             torch.randn(N_SAMPLES, DIM, generator=g, dtype=torch.float64))
    return TensorDataset(torch.randint(0, VOCAB, (N_SAMPLES, SEQ), generator=g))


def _fit(kind: str, plan: dict, accumulate: int, callbacks: list, timeout_s: float = 120) -> tuple[dict, Any]:
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    module = _build_module(kind, plan, accumulate)
    strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1, timeout=timedelta(seconds=timeout_s))
    trainer = Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=4 // accumulate, callbacks=callbacks,
                      accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(_data(kind), batch_size=BATCH, shuffle=False))
    weights = {k: v.full_tensor().detach().clone() for k, v in module.model.state_dict().items()}
    return weights, module


# One OOM per kind of failure, on rank 1 only: forward (size), mid-backward (size), and the backward
# of the last micro-batch of a step (call 3 = the 4th micro-batch of 2 once the size is 2).
PLAN = {(1, 1): ("forward", "size", 4), (1, 2): ("backward", "size", 2), (1, 3): ("backward", "call", 3)}


def _worker(rank: int, port: int, out_dir: str, tests_dir: str, scenario: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(WORLD))
    sys.path.insert(0, tests_dir)
    torch.set_num_threads(1)
    from lit_memopt.callbacks import OOMRecovery

    results: dict[str, Any] = {}
    if scenario == "negative_control":
        from lit_memopt.callbacks import _gradient_sync

        _gradient_sync.FSDP2Sync.guard = lambda self: None  # the guards off: nothing meets a failed rank
        recovery = OOMRecovery(grow_after_steps=None)
        _fit("mlp", PLAN, 1, [recovery], timeout_s=20)
        torch.save({"completed": True}, Path(out_dir) / f"rank{rank}.pt")
        return
    for kind in ("mlp", "qwen3"):
        for accumulate in (1, 2):
            reference, _ = _fit(kind, {}, accumulate, [])
            recovery = OOMRecovery(grow_after_steps=None)
            recovered, module = _fit(kind, PLAN, accumulate, [recovery])
            results[f"{kind}/{accumulate}"] = {
                "reference": reference, "recovered": recovered, "events": recovery.events,
                "history": recovery.history, "micro_sizes": module.seen_micro_sizes, "sync": recovery.gradient_sync,
            }
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def _spawn(tmp_path: Path, scenario: str, timeout_s: float) -> bool:
    """Run the scenario on 2 processes; True if both finished within ``timeout_s`` without error."""
    failure = run_ranks(_worker, (free_port(), str(tmp_path), str(Path(__file__).parent), scenario), nprocs=WORLD,
                        timeout_s=timeout_s)
    if failure is not None:
        print(f"[{scenario}] {failure}", file=sys.stderr)
    return failure is None


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsdp2_oom_on_one_rank_is_exact_and_keeps_ranks_in_step(tmp_path: Path) -> None:
    assert _spawn(tmp_path, "recover", timeout_s=360), "the FSDP2 run with OOMRecovery hung or failed"
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD))
    for key, a in r0.items():
        b = r1[key]
        assert a["sync"] == "FSDP2"
        strip = lambda events: [{k: v for k, v in e.items() if k != "message"} for e in events]  # noqa: E731
        # Decisions taken together: the same events and size changes on both ranks...
        assert strip(a["events"]) == strip(b["events"]) and a["history"] == b["history"], key
        assert [e["phase"] for e in a["events"]] == ["forward", "backward", "backward"], (key, a["events"])
        assert [h["to"] for h in a["history"]] == [4, 2, 1], key
        # ...where only rank 1 ran out of memory.
        assert all(e["message"] == "OOM on another rank" for e in a["events"]), key
        assert all("out of memory" in e["message"].lower() for e in b["events"]), key
        # Both ranks ran the same passes (the same collectives), and every weight equals the OOM-free run.
        assert a["micro_sizes"] == b["micro_sizes"], key
        for name, value in a["recovered"].items():
            assert torch.equal(value, b["recovered"][name]), (key, name)
            torch.testing.assert_close(value, a["reference"][name], atol=1e-12, rtol=0), (key, name)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_fsdp2_without_the_guards_hangs_or_aborts(tmp_path: Path) -> None:
    """The negative control: same OOMs, guards off. A rank that fails mid-pass leaves the other inside
    an FSDP collective; the run must not finish normally (it hangs until killed, or aborts)."""
    finished = _spawn(tmp_path, "negative_control", timeout_s=90)
    assert not finished or not all((tmp_path / f"rank{r}.pt").exists() for r in range(WORLD))

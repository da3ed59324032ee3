"""OOMRecovery: OOMs (real torch.OutOfMemoryError from memory_budget) in forward, backward and the optimizer
step are survived with the same weights as an OOM-free run, every sample counted once per step."""

from __future__ import annotations

import dataclasses
from pathlib import Path
import gc
from collections import namedtuple
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset

from lit_memopt.callbacks import OOMRecovery
from lit_memopt.callbacks._micro_batching import grow_size, infer_batch_size, shrink_size, slice_batch
from lit_memopt.callbacks.oom_recovery import OOMRecoveryError
from lit_memopt.memory import memory_budget

N_SAMPLES, DIM, HIDDEN, BATCH = 64, 6, 16, 8


# ------------------------------------------------------------------------------------ fixtures
class ToyData(Dataset):
    """Regression samples that carry their index, so each sample's contribution can be counted."""

    def __init__(self, n: int = N_SAMPLES, seq: int = 0) -> None:
        g = torch.Generator().manual_seed(1)
        shape = (n, seq, DIM) if seq else (n, DIM)
        self.x = torch.randn(*shape, generator=g)
        self.y = torch.randn(*shape, generator=g)
        # Ragged masks (>= 1 token per sample) make token weighting differ from sample weighting.
        self.mask = (torch.rand(n, seq, generator=g) < 0.6).long() if seq else None
        if seq:
            self.mask[:, 0] = 1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = {"x": self.x[i], "y": self.y[i], "idx": i}
        if self.mask is not None:
            item["attention_mask"] = self.mask[i]
        return item


class _OOMInBackward(torch.autograd.Function):
    """Identity whose backward allocates under a zero budget: a real OOM in the middle of backward,
    after the layers above it already accumulated their gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        with memory_budget(0):
            return grad * 1.0


class PlannedOOMModule(LightningModule):
    """A small MLP whose training_step OOMs (memory_budget) when its micro-batch exceeds a planned size.

    ``plan[(rank, epoch, batch_idx)] = (phase, largest size that fits)``; ``limit`` applies to every batch.
    """

    def __init__(self, plan: dict | None = None, limit: tuple[str, int] | None = None, optimizer: str = "sgd",
                 loss: str = "samples") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, DIM))
        # d(loss)/d(counter[j]) = (times sample j contributed) / B: the exactly-once probe.
        self.counter = torch.nn.Parameter(torch.zeros(N_SAMPLES))
        self.plan = plan or {}
        self.limit = limit
        self.optimizer_name = optimizer
        self.loss_kind = loss
        self.seen_micro_sizes: list[int] = []

    def _rule(self, batch_idx: int) -> tuple[str, int] | None:
        return self.plan.get((self.global_rank, self.current_epoch, batch_idx), self.limit)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch["x"], batch["y"], batch["idx"]
        n = x.shape[0]
        self.seen_micro_sizes.append(n)
        rule = self._rule(batch_idx)
        too_big = rule is not None and n > rule[1]
        if too_big and rule[0] == "forward":
            with memory_budget(0):  # the forward's first allocation passes the budget
                self.net(x)
        h = self.net[1](self.net[0](x))
        if too_big and rule[0] == "backward":
            h = _OOMInBackward.apply(h)
        out = self.net[2](h)
        if self.loss_kind == "tokens":
            mask = batch["attention_mask"].unsqueeze(-1).to(out.dtype)
            per_token = ((out.float() - y) ** 2).mean(-1, keepdim=True) * mask
            # Everything in this loss is a mean over tokens, the counter term included.
            loss = (per_token + self.counter[idx].view(-1, 1, 1) * mask).sum() / mask.sum()
        else:
            loss = ((out.float() - y) ** 2).mean() + self.counter[idx].mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ContributionProbe(Callback):
    """Before each optimizer step: how many times each sample contributed (should be 1 for the step's samples)."""

    def __init__(self) -> None:
        self.counts: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        scale = BATCH * trainer.accumulate_grad_batches
        self.counts.append(pl_module.counter.grad.detach().clone() * scale)


def make_trainer(callbacks: list, **kwargs: Any) -> Trainer:
    options = dict(
        accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return Trainer(callbacks=callbacks, **options)


def fit(module: LightningModule, callbacks: list, seq: int = 0, ckpt_path: str | None = None, **kwargs: Any) -> Trainer:
    trainer = make_trainer(callbacks, **kwargs)
    trainer.fit(module, DataLoader(ToyData(seq=seq), batch_size=BATCH, shuffle=False), ckpt_path=ckpt_path)
    return trainer


def weights(module: LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_weights(a: dict, b: dict, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


# ------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("accumulate", [1, 2])
def test_ooms_in_forward_and_backward_give_the_same_weights(accumulate: int) -> None:
    reference = PlannedOOMModule()
    ref_probe = ContributionProbe()
    fit(reference, [ref_probe], accumulate_grad_batches=accumulate)

    # OOMs in forward and backward at several batches, including the 2nd batch of an accumulation
    # window (its earlier-accumulated gradients must survive) and a mid-backward OOM.
    plan = {
        (0, 0, 1): ("forward", 4),  # 8 -> 4
        (0, 0, 3): ("backward", 3),  # 4 -> 2, mid-backward
        (0, 0, 4): ("forward", 1),  # 2 -> 1
    }
    module = PlannedOOMModule(plan=plan)
    probe = ContributionProbe()
    recovery = OOMRecovery(grow_after_steps=None)
    trainer = fit(module, [recovery, probe], accumulate_grad_batches=accumulate)

    assert trainer.global_step == 6
    assert recovery.oom_events == 3
    assert [e["phase"] for e in recovery.events] == ["forward", "backward", "forward"]
    assert [h["to"] for h in recovery.history] == [4, 2, 1]  # the sizes only shrink, never below what worked
    assert_same_weights(weights(module), weights(reference))
    # Every sample of each optimizer step contributed exactly once, others not at all.
    assert len(probe.counts) == len(ref_probe.counts) == 6
    for step, counts in enumerate(probe.counts):
        first = (step * BATCH * accumulate) % N_SAMPLES
        expected = torch.zeros(N_SAMPLES)
        expected[first:first + BATCH * accumulate] = 1.0
        torch.testing.assert_close(counts, expected, atol=1e-5, rtol=0)
    # The logged loss is the whole-batch loss (combined over micro-batches), and the sizes are logged.
    torch.testing.assert_close(trainer.callback_metrics["train/loss"], reference.trainer.callback_metrics["train/loss"])
    assert trainer.callback_metrics["memopt/micro_batch_size"].item() == 1.0
    assert trainer.callback_metrics["memopt/oom_events"].item() == 3.0


def test_token_weighting_matches_the_whole_batch_token_mean() -> None:
    reference = PlannedOOMModule(loss="tokens")
    fit(reference, [], seq=5)
    module = PlannedOOMModule(loss="tokens", plan={(0, 0, 0): ("forward", 4), (0, 0, 2): ("backward", 2)})
    recovery = OOMRecovery(loss_weighting="tokens", token_mask_key="attention_mask", grow_after_steps=None)
    fit(module, [recovery], seq=5)
    assert recovery.oom_events == 2
    assert_same_weights(weights(module), weights(reference))


def test_no_oom_is_bitwise_identical_and_logs_from_the_first_step() -> None:
    reference = PlannedOOMModule()
    fit(reference, [], max_steps=3)
    module = PlannedOOMModule()
    recovery = OOMRecovery()
    logged: list[dict] = []

    class Spy(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            logged.append({k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("memopt/")})

    fit(module, [recovery, Spy()], max_steps=3)
    for k, v in weights(reference).items():
        assert torch.equal(v, weights(module)[k]), k
    assert logged[0] == {"memopt/micro_batch_size": float(BATCH), "memopt/oom_events": 0.0}
    assert recovery.oom_events == 0 and recovery.micro_batch_size is None


def test_bf16_mixed_recovers() -> None:
    reference = PlannedOOMModule()
    fit(reference, [], precision="bf16-mixed")
    module = PlannedOOMModule(plan={(0, 0, 1): ("forward", 4), (0, 0, 3): ("backward", 2)})
    recovery = OOMRecovery(grow_after_steps=None)
    fit(module, [recovery], precision="bf16-mixed")
    assert recovery.oom_events == 2 and recovery.micro_batch_size == 2
    w = weights(module)
    assert all(torch.isfinite(v).all() for v in w.values())
    # bf16 micro-batches round differently from the whole batch; the trajectory must stay close.
    assert_same_weights(w, weights(reference), atol=3e-2, rtol=3e-2)


def test_16_mixed_with_grad_scaler_recovers() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    def run(module: LightningModule, callbacks: list) -> None:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        fit(module, callbacks, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])

    reference = PlannedOOMModule()
    run(reference, [])
    module = PlannedOOMModule(plan={(0, 0, 1): ("backward", 4), (0, 0, 2): ("forward", 2)})
    recovery = OOMRecovery(grow_after_steps=None)
    run(module, [recovery])
    assert recovery.oom_events == 2
    assert_same_weights(weights(module), weights(reference), atol=3e-2, rtol=3e-2)


# ------------------------------------------------------------------------------------ manual optimization
class ManualModule(PlannedOOMModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: dict, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        loss = OOMRecovery.run_micro_batches(self, batch, lambda mb: PlannedOOMModule.training_step(self, mb, batch_idx))
        opt.step()
        self.log("train/manual_loss", loss)


def test_manual_optimization_recovers_through_the_helper() -> None:
    reference = ManualModule()
    fit(reference, [])  # no OOMRecovery: the helper runs the whole batch once
    module = ManualModule(plan={(0, 0, 0): ("forward", 4), (0, 0, 2): ("backward", 2)})
    recovery = OOMRecovery(grow_after_steps=None)
    trainer = fit(module, [recovery])
    assert recovery.oom_events == 2 and recovery.micro_batch_size == 2
    assert_same_weights(weights(module), weights(reference))
    torch.testing.assert_close(trainer.callback_metrics["train/manual_loss"], reference.trainer.callback_metrics["train/manual_loss"])


# ------------------------------------------------------------------------------------ growth, resume, fatal
def test_grows_back_and_backs_off_without_thrashing() -> None:
    module = PlannedOOMModule(limit=("forward", 4), optimizer="sgd")
    recovery = OOMRecovery(grow_after_steps=2)
    fit(module, [recovery], max_steps=14)
    reasons = [h["reason"] for h in recovery.history]
    # 8 -> 4 on the first OOM; growth tries at 2, then 4, then 8 clean batches later, each stepping back.
    assert reasons == ["oom", "grow_failed", "grow_failed"]
    assert recovery.micro_batch_size == 4 and recovery.oom_events == 3
    trial_steps = [e["step"] for e in recovery.events]
    assert trial_steps == [0, 3, 8]
    # Once memory allows it, it grows back to the whole batch.
    module.limit = None
    recovery._grow_wait = 1
    fit(module, [recovery], max_steps=18)
    assert recovery.history[-1]["reason"] == "grow" and recovery.micro_batch_size == 8


def test_resume_continues_at_the_recovered_size(tmp_path) -> None:
    module = PlannedOOMModule(plan={(0, 0, 1): ("forward", 2)})
    recovery = OOMRecovery(grow_after_steps=None)
    trainer = fit(module, [recovery], max_steps=3)
    assert recovery.micro_batch_size == 2
    path = tmp_path / "oom.ckpt"
    trainer.save_checkpoint(path)

    resumed_module = PlannedOOMModule()
    resumed = OOMRecovery(grow_after_steps=None)
    fit(resumed_module, [resumed], max_steps=5, ckpt_path=str(path))
    assert resumed.micro_batch_size == 2 and resumed.oom_events == 2
    assert resumed.history == recovery.history and resumed.events == recovery.events
    # The two batches after step 3 run in micro-batches of 2 from the start: no OOM needed to get there.
    assert resumed_module.seen_micro_sizes == [2] * 8


def test_oom_at_the_minimum_size_stops_with_a_clear_error() -> None:
    module = PlannedOOMModule(plan={(0, 0, 2): ("backward", 0)})
    before = None

    class Remember(Callback):
        def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
            nonlocal before
            before = weights(pl_module)

    recovery = OOMRecovery(min_micro_batch_size=2, grow_after_steps=None)
    with pytest.raises(OOMRecoveryError) as info:
        fit(module, [recovery, Remember()])
    message = str(info.value)
    assert "out of memory in backward at step 2" in message
    assert "micro-batch size 2" in message and "min_micro_batch_size=2" in message
    assert "Memory: cpu" in message and "CUDA out of memory" in message
    # The failed step changed nothing: weights are those of the last completed step, no stale grads.
    assert_same_weights(weights(module), before, atol=0, rtol=0)
    assert all(p.grad is None for p in module.parameters())


# ------------------------------------------------------------------------------------ optimizer step
class OptimizerStepBudget(Callback):
    """Puts the optimizer step under a memory budget; ``garbage_bytes`` of cyclic garbage is counted in
    it until a ``gc.collect()`` frees it (what OOMRecovery does before retrying)."""

    def __init__(self, budget_bytes: int, garbage_bytes: int, at_batch: int = 0) -> None:
        self.budget_bytes, self.garbage_bytes, self.at_batch = budget_bytes, garbage_bytes, at_batch
        self.mode = None

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if trainer.global_step != self.at_batch:
            return
        gc.disable()
        self.mode = memory_budget(self.budget_bytes)
        self.mode.__enter__()
        cycle: list[Any] = [torch.zeros(self.garbage_bytes // 4)]
        cycle.append(cycle)  # unreachable after this hook, alive until gc.collect()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
            gc.enable()

    on_exception = on_train_batch_end


def _adam_state_bytes(module: LightningModule) -> int:
    return 2 * sum(p.numel() * 4 for p in module.parameters())


def test_optimizer_step_oom_is_retried_once_after_freeing() -> None:
    reference = PlannedOOMModule(optimizer="adam")
    fit(reference, [], max_steps=3)
    module = PlannedOOMModule(optimizer="adam")
    state = _adam_state_bytes(module)
    # Adam's first step allocates its state (2x params): it fits only once the garbage is collected.
    budget = OptimizerStepBudget(budget_bytes=2 * state + state // 2, garbage_bytes=2 * state)
    recovery = OOMRecovery()
    fit(module, [recovery, budget], max_steps=3)
    assert [e["phase"] for e in recovery.events] == ["optimizer"]
    assert_same_weights(weights(module), weights(reference))


def test_optimizer_step_oom_that_persists_is_reported() -> None:
    module = PlannedOOMModule(optimizer="adam")
    budget = OptimizerStepBudget(budget_bytes=1024, garbage_bytes=0)
    with pytest.raises(OOMRecoveryError, match="optimizer step at step 0.*ran out of memory again"):
        fit(module, [OOMRecovery(), budget], max_steps=2)


# ------------------------------------------------------------------------------------ batches
Pair = namedtuple("Pair", ["inputs", "targets"])


@dataclasses.dataclass
class Sample:
    tokens: torch.Tensor
    names: list[str]
    temperature: float = 1.0


def test_batches_of_any_structure_split_into_their_samples() -> None:
    from transformers import BatchEncoding

    x = torch.arange(10).reshape(5, 2)
    nested = {
        "enc": BatchEncoding({"input_ids": x, "attention_mask": torch.ones(5, 2)}),
        "pair": Pair(x + 100, [f"t{i}" for i in range(5)]),
        "items": ["a", "b", "c", "d", "e"],
        "ragged": [[1], [2, 2], [3], [4, 4, 4], [5]],
        "scale": torch.tensor(3.0),
        "sample": Sample(x * 2, ["n0", "n1", "n2", "n3", "n4"]),
        "tuple": (x, "tag"),
    }
    assert infer_batch_size(nested) == 5
    part = slice_batch(nested, 1, 3, 5)
    assert isinstance(part["enc"], BatchEncoding) and torch.equal(part["enc"]["input_ids"], x[1:3])
    assert isinstance(part["pair"], Pair) and part["pair"].targets == ["t1", "t2"]
    assert part["items"] == ["b", "c"] and part["ragged"] == [[2, 2], [3]]
    assert part["scale"].item() == 3.0
    assert isinstance(part["sample"], Sample) and part["sample"].names == ["n1", "n2"] and part["sample"].temperature == 1.0
    assert torch.equal(part["tuple"][0], x[1:3]) and part["tuple"][1] == "tag"
    assert infer_batch_size(["p1", "p2", "p3"]) == 3
    with pytest.raises(ValueError, match="split_fn"):
        infer_batch_size({"a": 1})


def test_sizes_shrink_and_grow() -> None:
    assert [shrink_size(m, 12, "halve") for m in (12, 6, 3, 2)] == [6, 3, 2, 1]
    assert [shrink_size(m, 12, "divisor") for m in (12, 6, 4, 3, 2)] == [6, 4, 3, 2, 1]
    assert [grow_size(m, 12, "halve") for m in (1, 3, 6, 12)] == [2, 6, 12, 12]
    assert [grow_size(m, 12, "divisor") for m in (1, 2, 4, 6)] == [2, 3, 6, 12]


def test_custom_split_fn_and_divisor_policy() -> None:
    reference = PlannedOOMModule()
    fit(reference, [], max_steps=3)

    def split_fn(batch: dict, size: int) -> list[dict]:
        n = batch["x"].shape[0]
        return [{k: v[s:s + size] for k, v in batch.items()} for s in range(0, n, size)]

    module = PlannedOOMModule(plan={(0, 0, 0): ("forward", 3)})
    recovery = OOMRecovery(split_fn=split_fn, shrink="divisor", grow_after_steps=None)
    fit(module, [recovery], max_steps=3)
    assert [h["to"] for h in recovery.history] == [4, 2]
    assert_same_weights(weights(module), weights(reference))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"initial_micro_batch_size": 0}, "initial_micro_batch_size"),
        ({"initial_micro_batch_size": "big"}, "initial_micro_batch_size"),
        ({"min_micro_batch_size": 0}, "min_micro_batch_size"),
        ({"initial_micro_batch_size": 2, "min_micro_batch_size": 4}, "initial_micro_batch_size"),
        ({"shrink": "third"}, "shrink"),
        ({"grow_after_steps": 0}, "grow_after_steps"),
        ({"max_memory_fraction": 1.5}, "max_memory_fraction"),
        ({"loss_weighting": "bytes"}, "loss_weighting"),
        ({"split_fn": 3}, "split_fn"),
        ({"max_micro_batch_size": 0}, "max_micro_batch_size"),
    ],
)
def test_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OOMRecovery(**kwargs)


# ------------------------------------------------------------------------------------ integration
def test_reports_ooms_and_size_changes_to_memory_monitor(tmp_path) -> None:
    from lit_memopt.callbacks import MemoryMonitor

    monitor = MemoryMonitor(write_report=False, output_dir=str(tmp_path))
    module = PlannedOOMModule(plan={(0, 0, 1): ("backward", 4)})
    fit(module, [OOMRecovery(grow_after_steps=None), monitor], max_steps=3)
    assert [(e.step, e.phase, e.batch_size) for e in monitor.metrics.oom_events] == [(1, "backward", 8)]
    change = monitor.metrics.batch_size_changes
    assert [(c.step, c.old_batch_size, c.new_batch_size, c.reason) for c in change] == [(1, 8, 4, "oom")]


def test_unsupported_strategy_warns_and_stays_out_of_the_way() -> None:
    from types import SimpleNamespace

    recovery = OOMRecovery()
    fake_trainer = SimpleNamespace(strategy=object())
    module = PlannedOOMModule()
    with pytest.warns(UserWarning, match="OOMRecovery supports the single-device and DDP strategies"):
        recovery.setup(fake_trainer, module, "fit")  # type: ignore[arg-type]
    assert "training_step" not in module.__dict__  # the module was not wrapped


def test_default_callbacks_config_builds_oom_recovery() -> None:
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf / "callbacks"), version_base="1.3"):
        cfg = compose(config_name="default")
    callback = instantiate(cfg.oom_recovery)
    assert isinstance(callback, OOMRecovery)
    defaults = OOMRecovery()
    for key in cfg.oom_recovery:
        if key != "_target_":
            assert getattr(callback, key) == getattr(defaults, key), key


# ------------------------------------------------------------------------------------ a measured budget
class WideModule(LightningModule):
    """Activations dominate its memory: the micro-batch size decides whether a step fits a budget."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, DIM))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return ((self.net(batch["x"]) - batch["y"]) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BudgetPerStep(Callback):
    """Every forward/backward of a training batch runs under one memory budget (None: measure only)."""

    def __init__(self, budget_bytes: int | None) -> None:
        self.budget_bytes, self.mode, self.peaks = budget_bytes, None, []

    def on_train_batch_start(self, *args: Any) -> None:
        self.mode = memory_budget(self.budget_bytes)
        self.mode.__enter__()

    def _leave(self, *args: Any) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.peaks.append(self.mode.peak_bytes)
            self.mode = None

    on_before_optimizer_step = _leave
    on_exception = _leave


def test_a_budget_between_two_measured_peaks_settles_on_the_size_that_fits() -> None:
    peaks = {}
    for size in (4, 8):
        probe = BudgetPerStep(None)
        fit(WideModule(), [OOMRecovery(initial_micro_batch_size=size, grow_after_steps=None), probe], max_steps=3)
        peaks[size] = max(probe.peaks)
    assert peaks[8] > peaks[4]
    reference = WideModule()
    fit(reference, [], max_steps=3)
    module = WideModule()
    recovery = OOMRecovery(grow_after_steps=None)
    fit(module, [recovery, BudgetPerStep((peaks[4] + peaks[8]) // 2)], max_steps=3)
    # The whole batch (8) passes the budget once; 4 fits from then on, with unchanged results.
    assert [(e["step"], e["micro_batch_size"]) for e in recovery.events] == [(0, 8)]
    assert recovery.micro_batch_size == 4
    assert_same_weights(weights(module), weights(reference))


def test_loggers_get_a_row_at_the_first_step_and_at_every_change(tmp_path) -> None:
    import csv

    from lightning.pytorch.loggers import CSVLogger

    module = PlannedOOMModule(plan={(0, 0, 2): ("forward", 4)})
    logger = CSVLogger(str(tmp_path), name="run")
    fit(module, [OOMRecovery(grow_after_steps=None)], max_steps=4, logger=logger, log_every_n_steps=50)
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    written = [(int(r["step"]), float(r["memopt/micro_batch_size"]), float(r["memopt/oom_events"]))
               for r in rows if r.get("memopt/micro_batch_size")]
    # Step 0 with the whole batch; the OOM at the third batch (global step 2) right when it happened.
    assert written == [(0, 8.0, 0.0), (2, 4.0, 1.0)]

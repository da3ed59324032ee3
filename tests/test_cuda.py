"""What only a GPU can check: the fused head's CUDA paths (bf16 operands multiplied into fp32 tiles, the
free-memory cap on tiles, the device's real peak memory) and OOMRecovery surviving a real CUDA
out-of-memory error. Every test is marked ``cuda`` and skips itself where no CUDA device is present
(``conftest.py``); run them with ``pytest -m cuda`` on a GPU machine."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset

from lit_memopt.callbacks import OOMRecovery
from lit_memopt.ops import (
    linear_entropy,
    linear_kl,
    linear_logprobs,
    linear_logprobs_and_entropy,
    linear_self_certainty,
)
from lit_memopt.ops import _head_tiles

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


def make(n: int, hidden_size: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 2 / hidden_size**0.5).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    return hidden.to(CUDA).requires_grad_(), weight.to(CUDA).requires_grad_(), targets.to(CUDA)


def reference(op: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The op in float64 on the CPU, from full logits."""
    z = hidden.double().cpu() @ weight.double().cpu().T
    logp = torch.log_softmax(z, -1)
    picked = logp.gather(-1, targets.cpu().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    if op == "logprobs":
        return picked
    if op == "entropy":
        return entropy
    if op == "self_certainty":
        return torch.logsumexp(z, -1) - z.mean(-1)
    if op == "logprobs_and_entropy":
        return torch.stack([picked, entropy])
    raise ValueError(op)


FUSED = {
    "logprobs": lambda h, w, t, **kw: linear_logprobs(h, w, t, **kw),
    "entropy": lambda h, w, t, **kw: linear_entropy(h, w, **kw),
    "self_certainty": lambda h, w, t, **kw: linear_self_certainty(h, w, **kw),
    "logprobs_and_entropy": lambda h, w, t, **kw: torch.stack(linear_logprobs_and_entropy(h, w, t, **kw)),
}


def gradients(out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return torch.autograd.grad((out * up.to(out.device, out.dtype)).sum(), inputs)


@pytest.mark.parametrize("op", sorted(FUSED))
def test_exact_fp32_on_cuda_matches_float64(op: str) -> None:
    hidden, weight, targets = make(300, 64, 1000, torch.float32)
    out = FUSED[op](hidden, weight, targets, chunk_size=(128, 256))
    ref_h, ref_w = hidden.detach().cpu().double().requires_grad_(), weight.detach().cpu().double().requires_grad_()
    want = reference(op, ref_h, ref_w, targets)
    torch.testing.assert_close(out.double().cpu().detach(), want.detach(), rtol=1e-5, atol=1e-5)
    for got, exp in zip(gradients(out, (hidden, weight)), gradients(want, (ref_h, ref_w))):
        torch.testing.assert_close(got.double().cpu(), exp, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", sorted(FUSED))
def test_fast_bf16_on_cuda_multiplies_into_fp32_tiles(op: str) -> None:
    # On CUDA "fast" multiplies the bf16 operands into fp32 logits (no bf16 rounding of the logits), so its
    # values match the float64 maths on the same bf16 inputs to fp32 accuracy; the logit-gradient tile is
    # rounded to bf16 for the backward products, so gradients sit at the bf16 floor.
    _head_tiles._FP32_OUT_IN_PLACE.clear()
    hidden, weight, targets = make(300, 64, 1000, torch.bfloat16)
    fast = FUSED[op](hidden, weight, targets, chunk_size=(128, 256), precision="fast")
    fast_grads = gradients(fast, (hidden, weight))
    assert set(_head_tiles._FP32_OUT_IN_PLACE) == {"mm", "addmm"}  # the CUDA fp32-output products ran
    exact = FUSED[op](hidden, weight, targets, chunk_size=(128, 256), precision="exact")
    ref_h, ref_w = hidden.detach().cpu().double().requires_grad_(), weight.detach().cpu().double().requires_grad_()
    want = reference(op, ref_h, ref_w, targets)
    for out in (fast, exact):
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double().cpu().detach(), want.detach(), rtol=1e-4, atol=1e-4)
    want_grads = gradients(want, (ref_h, ref_w))
    for grads in (fast_grads, gradients(exact, (hidden, weight))):
        for got, exp in zip(grads, want_grads):
            assert got.dtype == torch.bfloat16
            assert (got.double().cpu() - exp).abs().max().item() <= 0.02 * exp.abs().max().item()


@pytest.mark.parametrize("op", sorted(FUSED))
def test_auto_under_bf16_autocast_multiplies_fp32_weights_in_bf16(op: str) -> None:
    # Lightning's "bf16-mixed": fp32 weights and hidden states under autocast. "auto" multiplies bf16 copies of
    # the tiles into fp32 logits, so values match the float64 maths on the bf16-rounded inputs to fp32
    # accuracy, and the gradients come back in fp32.
    _head_tiles._FP32_OUT_IN_PLACE.clear()
    hidden, weight, targets = make(300, 64, 1000, torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = FUSED[op](hidden, weight, targets, chunk_size=(128, 256))
    grads = gradients(out, (hidden, weight))
    assert set(_head_tiles._FP32_OUT_IN_PLACE) == {"mm", "addmm"}  # bf16 operands, fp32 products
    ref_h = hidden.detach().bfloat16().cpu().double().requires_grad_()
    ref_w = weight.detach().bfloat16().cpu().double().requires_grad_()
    want = reference(op, ref_h, ref_w, targets)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double().cpu().detach(), want.detach(), rtol=1e-4, atol=1e-4)
    for got, exp in zip(grads, gradients(want, (ref_h, ref_w))):
        assert got.dtype == torch.float32
        assert (got.double().cpu() - exp).abs().max().item() <= 0.02 * exp.abs().max().item()


def test_kl_and_masking_on_cuda() -> None:
    hidden, weight, targets = make(200, 32, 500, torch.float32)
    ref_hidden = (hidden.detach() + 0.2 * torch.randn_like(hidden)).requires_grad_(False)
    kl = linear_kl(hidden, weight, ref_hidden, weight.detach() * 0.9, chunk_size=(64, 128))
    logp = torch.log_softmax(hidden.double().cpu() @ weight.double().cpu().T, -1)
    logq = torch.log_softmax(ref_hidden.double().cpu() @ (weight.detach().double().cpu() * 0.9).T, -1)
    torch.testing.assert_close(kl.double().cpu().detach(), (logp.exp() * (logp - logq)).sum(-1).detach(), rtol=1e-5, atol=1e-5)
    mask = torch.zeros(200, dtype=torch.bool, device=CUDA)
    mask[::4] = True
    out = linear_logprobs(hidden, weight, targets, mask=mask)
    assert torch.all(out[~mask] == 0)
    torch.testing.assert_close(out[mask].double().cpu().detach(), reference("logprobs", hidden, weight, targets)[mask.cpu()].detach(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_a_head_call_waits_for_the_gpu_once(masked: bool) -> None:
    """Each host sync stalls the Python side of the pass until the queued kernels finish: a call with
    targets (and a mask) reads what its plan needs from the data in one, forward and backward together."""
    hidden, weight, targets = make(256, 64, 1000, torch.bfloat16)
    mask = None
    if masked:
        targets[:100] = -100
        mask = torch.ones(256, dtype=torch.bool, device=CUDA)
        mask[200:] = False

    def step() -> None:
        linear_logprobs(hidden, weight, targets, mask=mask).sum().backward()

    step()  # the first call compiles the tile kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [r for r in record if "synchroniz" in str(r.message).lower()]
    assert len(syncs) == 1, [str(r.message) for r in syncs]


def test_tiles_are_capped_by_free_cuda_memory() -> None:
    free, _ = torch.cuda.mem_get_info()
    rows, cols = _head_tiles.tile_sizes(None, 1 << 20, 8192, 262144, CUDA, fast=True)
    assert rows * cols * 4 <= free // _head_tiles.CUDA_FREE_FRACTION
    assert rows * cols <= _head_tiles.MAX_TILE_ELEMENTS


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_real_peak_memory_on_cuda_is_a_fraction_of_full_logits(precision: str) -> None:
    n, h, v = 4096, 1024, 50000
    hidden, weight, targets = make(n, h, v, torch.bfloat16)
    grads = hidden.numel() * 2 + weight.numel() * 2

    def extra_peak(step) -> int:
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before - grads

    def naive() -> None:
        logits = (hidden @ weight.T).float()
        torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).sum().backward()

    def fused() -> None:
        linear_logprobs(hidden, weight, targets, precision=precision).sum().backward()

    naive_extra, fused_extra = extra_peak(naive), extra_peak(fused)
    logits_bytes = n * v * 4
    assert naive_extra >= 2 * logits_bytes
    assert fused_extra <= 0.1 * naive_extra, (fused_extra, naive_extra)


# ------------------------------------------------------------------------- a real CUDA OOM, survived
SAMPLES, SEQ, WIDTH, BATCH = 32, 2048, 2048, 8


class Wide(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, SEQ, 256, generator=g)
        self.y = torch.randn(SAMPLES, SEQ, 256, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class WideOnCuda(LightningModule):
    """Activations ([batch, 2048, 2048] fp32, four saved per step) dominate: a micro-batch of 8 needs about twice
    the memory of 4, so a cap between the two peaks turns the whole batch into a real CUDA OOM."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(256, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH),
                                       torch.nn.GELU(), torch.nn.Linear(WIDTH, 256))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return ((self.net(batch["x"]) - batch["y"]) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit_on_cuda(callbacks: list, steps: int = 3) -> tuple[WideOnCuda, int]:
    module = WideOnCuda()
    trainer = Trainer(accelerator="cuda", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, DataLoader(Wide(), batch_size=BATCH))
    peak = torch.cuda.max_memory_allocated()
    return module, peak


def test_oom_recovery_survives_a_real_cuda_oom_with_the_unsplit_weights() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    reference, peak_8 = fit_on_cuda([])
    reference_weights = {k: v.detach().cpu() for k, v in reference.state_dict().items()}
    del reference
    _, peak_4 = fit_on_cuda([OOMRecovery(initial_micro_batch_size=4, grow_after_steps=None)])
    assert peak_8 > 1.5 * peak_4, (peak_8, peak_4)  # activations dominate, so the cap below separates them
    torch.cuda.empty_cache()
    cap = (peak_4 + peak_8) // 2
    recovery = OOMRecovery(grow_after_steps=None)
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        module, _ = fit_on_cuda([recovery])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    # The whole batch hit the cap once (a torch.OutOfMemoryError from the CUDA allocator); 4 fits from then on.
    assert [(e["step"], e["micro_batch_size"]) for e in recovery.events] == [(0, 8)], recovery.events
    assert recovery.micro_batch_size == 4
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value.detach().cpu(), reference_weights[key], rtol=1e-4, atol=1e-5, msg=key)

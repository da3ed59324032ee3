"""The micro-batch loop of ``OOMRecovery``: one loader batch, forward and backward in micro-batches.

Each micro-batch loss is scaled by its share of the batch (samples, tokens, or weight 1), so the
accumulated gradient is the whole-batch gradient. After every micro-batch the ranks agree on the
outcome; on an OOM anywhere the attempt's gradients are dropped, the size shrinks (the size
policy decides) and the **same samples** are retried. The gradient-sync backend adds what the
strategy needs (DDP: average after the step; FSDP2: guarded collectives, reset after a failure).
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lit_memopt.callbacks._gradient_sync import GradientSync
from lit_memopt.callbacks._log_replay import LogCall, capture_logs
from lit_memopt.callbacks._micro_batching import call_with_autocast_disabled, infer_batch_size, micro_batch_bounds, slice_batch
from lit_memopt.callbacks._optimizer_retry import oom_message
from lit_memopt.callbacks._rank_agreement import ERROR, OK, OOM, PHASE_CODES, PHASES, PeerFailure, RankAgreement
from lit_memopt.memory.oom import is_oom_error

__all__ = ["add_gradients", "restore_gradients", "SplitOptions", "Attempt", "split_batch", "run_attempt", "loss_of", "combine_outputs", "empty_cache"]

LOSS_WEIGHTINGS = ("samples", "tokens", "none")


@dataclass
class SplitOptions:
    """How a batch is split and how each micro-batch's loss is weighted (see ``OOMRecovery``'s arguments)."""

    loss_weighting: str = "samples"
    split_fn: Callable[[Any, int], list[Any]] | None = None
    batch_size_fn: Callable[[Any], int] | None = None

    def batch_size(self, batch: Any) -> int:
        return int(self.batch_size_fn(batch)) if self.batch_size_fn is not None else infer_batch_size(batch)


@dataclass
class Attempt:
    """The outcome of running every micro-batch of a batch at one size, agreed by all ranks."""

    status: int
    phase: str = ""
    message: str = ""
    error: BaseException | None = None
    loss: torch.Tensor | None = None
    output: Any = None
    logs: list[tuple[float, list[LogCall]]] | None = None


def split_batch(batch: Any, batch_size: int, size: int, tokens: torch.Tensor | None, options: SplitOptions) -> tuple[list[Any], list[float]]:
    """Micro-batches of at most ``size`` samples covering ``batch`` once, and each one's share of the loss."""
    if options.split_fn is not None:
        micro_batches = list(options.split_fn(batch, size))
        sizes = [options.batch_size(mb) for mb in micro_batches]
        if sum(sizes) != batch_size:
            raise ValueError(
                f"OOMRecovery: split_fn returned micro-batches of {sizes} samples for a batch of {batch_size}; "
                "they must cover every sample exactly once"
            )
        bounds, start = [], 0
        for n in sizes:
            bounds.append((start, start + n))
            start += n
    else:
        bounds = micro_batch_bounds(batch_size, size)
        micro_batches = [slice_batch(batch, s, e, batch_size) if (s, e) != (0, batch_size) else batch for s, e in bounds]
    if options.loss_weighting == "none":
        shares = [1.0] * len(bounds)
    elif options.loss_weighting == "tokens" and tokens is not None and int(tokens.sum()) > 0:
        total = float(tokens.sum())
        shares = [float(tokens[s:e].sum()) / total for s, e in bounds]
    else:
        shares = [(e - s) / batch_size for s, e in bounds]
    return micro_batches, shares


def run_attempt(
    module: LightningModule,
    micro_batches: list[Any],
    shares: list[float],
    normalize: int,
    compute: Callable[[Any], Any],
    backward: Callable[[torch.Tensor], Any],
    agree: RankAgreement,
    sync: GradientSync,
) -> Attempt:
    """Forward and backward every micro-batch; stop at the first failure on any rank.

    Every rank runs the same number of agreement points: one per micro-batch (the largest count
    over ranks) plus, under FSDP2, one inside each guarded collective. A rank with fewer
    micro-batches agrees without computing; under FSDP2, whose passes hold collectives, it reruns
    its last micro-batch with weight 0 instead.
    """
    (count,) = agree.max(len(micro_batches))
    scaler = getattr(module.trainer.precision_plugin, "scaler", None)
    device_type = module.device.type
    total: torch.Tensor | None = None
    outputs: list[tuple[Any, float]] = []
    logs: list[tuple[float, list[LogCall]]] = []
    for i in range(count):
        status, phase_code, message, error = OK, 0, "", None
        agreed: tuple[int, int] | None = None
        padding = i >= len(micro_batches)
        if not padding or sync.needs_equal_pass_count:
            micro, share = (micro_batches[i], shares[i]) if not padding else (micro_batches[-1], 0.0)
            sink: list[LogCall] = []
            phase_code = PHASE_CODES["forward"]
            out = loss = scaled = None
            try:
                with sync.attempt(), capture_logs(module, sink):
                    out = compute(micro)
                    loss = loss_of(out)
                    if loss is not None:
                        phase_code = PHASE_CODES["backward"]
                        scaled = loss * (share / normalize)
                        if scaler is not None and module.automatic_optimization:
                            scaled = scaler.scale(scaled)
                        call_with_autocast_disabled(lambda: backward(scaled), device_type)
                if not padding:
                    if loss is not None:
                        contribution = loss.detach() * share
                        total = contribution if total is None else total + contribution
                    outputs.append((_detach_output(out), share))
                    logs.append((share, sink))
            except PeerFailure as peer:
                agreed = (peer.status, peer.phase_code)  # the agreement happened inside a guarded collective
            except Exception as e:  # noqa: BLE001 - classified right below, re-raised if not an OOM
                if is_oom_error(e):
                    status, message = OOM, oom_message(e)
                else:
                    status, error = ERROR, e
            # Outside the except block: the OOM's traceback (and the frames holding activations)
            # is gone; drop this attempt's tensors before anything else allocates.
            out = loss = scaled = None
        if agreed is None:
            agreed = agree.status(status, phase_code)
        if agreed[0] != OK:
            return Attempt(agreed[0], PHASES.get(agreed[1], "unknown"), message or "OOM on another rank", error)
    return Attempt(OK, loss=total, output=combine_outputs(outputs, total, normalize), logs=logs)


def loss_of(output: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned (a Tensor, a dict with ``loss``, or ``None``)."""
    if output is None:
        return None
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        if "loss" not in output:
            raise MisconfigurationException("training_step returned a dict without a 'loss' key")
        return output["loss"]
    raise MisconfigurationException(
        f"training_step must return a Tensor, a dict with 'loss', or None; got {type(output).__name__}"
    )


def _detach_output(output: Any) -> Any:
    if isinstance(output, Mapping):
        return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in output.items()}
    return None if output is None else True


def combine_outputs(outputs: list[tuple[Any, float]], total: torch.Tensor | None, normalize: int) -> Any:
    """One ``training_step`` output for the whole batch: 0-dim tensors combined like the loss, the rest from the last micro-batch."""
    if total is None:
        return None
    dicts = [(o, s) for o, s in outputs if isinstance(o, Mapping)]
    if not dicts:
        return total
    combined: dict[str, Any] = {"loss": total}
    for key in dicts[-1][0]:
        if key == "loss":
            continue
        values = [(o[key], s) for o, s in dicts if key in o]
        if all(isinstance(v, torch.Tensor) and v.ndim == 0 and v.is_floating_point() for v, _ in values):
            weight = sum(s for _, s in values)
            combined[key] = sum(v * s for v, s in values) / weight
        else:
            combined[key] = values[-1][0]
    return combined


def restore_gradients(params: list[torch.nn.Parameter], grads: list[torch.Tensor | None]) -> None:
    """Put ``grads`` back as the parameters' ``.grad`` (how the loop sets gradients aside and returns them)."""
    for p, g in zip(params, grads):
        p.grad = g


def add_gradients(params: list[torch.nn.Parameter], new_grads: list[torch.Tensor | None], average: Callable[[], None] | None) -> None:
    """Add this batch's ``new_grads`` to the parameters' gradients; ``average()`` first averages the new ones
    over ranks (earlier accumulated gradients were averaged already)."""
    if average is not None:
        stash = [p.grad for p in params]
        restore_gradients(params, new_grads)
        average()
        new_grads = [p.grad for p in params]
        restore_gradients(params, stash)
    for p, g in zip(params, new_grads):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


def empty_cache() -> None:
    """Collect garbage and give cached device memory back after a failed attempt."""
    from lightning.pytorch.utilities.memory import garbage_collection_cuda

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        garbage_collection_cuda()  # gc, then the CUDA cache (tolerating an OOM inside empty_cache itself)
    else:
        gc.collect()
    # Lightning's helper covers CUDA only; the other accelerators' caches are emptied here.
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()

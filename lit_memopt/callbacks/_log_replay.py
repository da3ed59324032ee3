"""What a module logs inside ``training_step`` while ``OOMRecovery`` splits the batch.

Values logged by each micro-batch are captured, then combined over the successful attempt's
micro-batches (``mean`` weighted by each micro-batch's share, ``sum``, ``max``, ``min``) and
logged once, so ``train/loss`` is the whole-batch value and a failed attempt logs nothing.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from lightning.pytorch import LightningModule

__all__ = ["capture_logs", "LogReplay"]

# (name, value, positional args, keyword args) of one self.log call
LogCall = tuple[str, Any, tuple, dict]


@contextmanager
def capture_logs(module: LightningModule, sink: list[LogCall]) -> Iterator[None]:
    """Route ``module.log`` calls into ``sink`` for the duration of the block."""
    previous = module.__dict__.get("log")

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        sink.append((name, value, args, kwargs))

    module.log = log  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is None:
            module.__dict__.pop("log", None)
        else:
            module.log = previous  # type: ignore[method-assign]


class LogReplay:
    """Logs the captured calls of one batch's micro-batches, combined per name."""

    def __init__(self) -> None:
        self._signature: inspect.Signature | None = None

    def replay(self, module: LightningModule, logs: list[tuple[float, list[LogCall]]]) -> None:
        if not any(sink for _, sink in logs):
            return
        names: dict[str, list[tuple[Any, float, tuple, dict]]] = {}
        for share, sink in logs:
            for name, value, args, kwargs in sink:
                names.setdefault(name, []).append((value, share, args, kwargs))
        for name, calls in names.items():
            value, _, args, kwargs = calls[-1]
            if len(calls) == 1:
                module.log(name, value, *args, **kwargs)  # one micro-batch: nothing to combine
                continue
            if self._signature is None:
                self._signature = inspect.signature(type(module).log)
            try:
                bound = self._signature.bind(module, name, value, *args, **kwargs)
                reduce_fx = bound.arguments.get("reduce_fx", "mean")
            except TypeError:
                reduce_fx = "mean"
            combined = reduce_logged([(v, s) for v, s, _, _ in calls], reduce_fx)
            module.log(name, combined, *args, **kwargs)


def reduce_logged(values: list[tuple[Any, float]], reduce_fx: Any) -> Any:
    """Combine ``(value, share)`` pairs as Lightning's ``reduce_fx`` would over the whole batch."""
    last = values[-1][0]
    if len(values) == 1 or not all(isinstance(v, (torch.Tensor, int, float)) and not isinstance(v, bool) for v, _ in values):
        return last  # e.g. a torchmetrics Metric: it accumulated its own state per micro-batch
    fx = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "")
    aggregator = _AGGREGATORS.get(fx)
    if aggregator is None:
        return last
    from torchmetrics import aggregation

    device = last.device if isinstance(last, torch.Tensor) else torch.device("cpu")
    # torchmetrics' aggregation metrics, local to this rank (Lightning's logging syncs ranks afterwards).
    metric = getattr(aggregation, aggregator)(nan_strategy="disable", sync_on_compute=False).to(device)
    for value, share in values:
        value = torch.as_tensor(value, device=device).detach().float().reshape(())
        if aggregator == "MeanMetric":
            metric.update(value, weight=torch.tensor(share, device=device))
        else:
            metric.update(value)
    return metric.compute()


# Lightning's reduce_fx names -> torchmetrics aggregation metric (MeanMetric is weighted by the shares)
_AGGREGATORS = {"mean": "MeanMetric", "sum": "SumMetric", "max": "MaxMetric", "amax": "MaxMetric", "min": "MinMetric",
                "amin": "MinMetric"}

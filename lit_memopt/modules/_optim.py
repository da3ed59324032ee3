"""The optimizer most recipes use: AdamW with a linear learning-rate warm-up, stepped per optimizer step."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch


def adamw_with_warmup(
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    weight_decay: float,
    betas: Sequence[float],
    warmup_steps: int,
) -> dict[str, Any]:
    """``configure_optimizers`` output: AdamW, its rate rising linearly over ``warmup_steps``, then constant."""
    optimizer = torch.optim.AdamW(list(params), lr=lr, weight_decay=weight_decay, betas=tuple(betas))
    warmup = max(1, int(warmup_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

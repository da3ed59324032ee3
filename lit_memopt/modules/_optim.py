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
    """``configure_optimizers`` output: AdamW, its rate rising linearly over ``warmup_steps``, then constant
    (transformers' ``get_constant_schedule_with_warmup``: step ``s < warmup_steps`` runs at ``s / warmup_steps``)."""
    from transformers import get_constant_schedule_with_warmup

    optimizer = torch.optim.AdamW(list(params), lr=lr, weight_decay=weight_decay, betas=tuple(betas))
    scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=int(warmup_steps))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

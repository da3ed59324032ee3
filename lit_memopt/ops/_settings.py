"""The fused head's process-wide switches: the two environment variables that say how its tile maths may run.

``LIT_MEMOPT_FUSED_TILES``
    ``"auto"`` (default): the per-tile softmax maths (``_fused_tiles.py``) run as kernels compiled by
    ``torch.compile`` on CUDA and eagerly elsewhere; ``"1"``: compiled wherever torch.compile works (a CPU too,
    as the tests do); ``"0"``: always eager. Fake tensors (the peak-memory estimator) always run them eagerly.
``LIT_MEMOPT_WHOLE_PASS``
    ``"auto"`` (default): on CUDA, a call whose counted rows fit one row tile runs each pass as one compiled
    graph over all its vocabulary tiles (``_whole_pass.py``); ``"1"``: the same wherever the tile maths are
    compiled; ``"0"``: tile by tile everywhere.

This module only reads and checks them; ``linear_head.plan_pass`` is the one place that turns them, with the
device and the shapes of a call, into the variant that call runs. They are looked up at each head call, not
once per process, because the GPU benchmark (``benchmarks/peers_cuda.py``) and the tests flip them between calls;
each value is checked once and the parsed settings are cached.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

FUSED_TILES_ENV = "LIT_MEMOPT_FUSED_TILES"
WHOLE_PASS_ENV = "LIT_MEMOPT_WHOLE_PASS"
MODES = ("auto", "0", "1")


@dataclass(frozen=True)
class HeadSettings:
    """The two switches, checked: each one of :data:`MODES`."""

    fused_tiles: str = "auto"
    whole_pass: str = "auto"

    def compiled_tiles(self, device: torch.device, fake: bool) -> bool:
        """Whether the tile maths run as compiled kernels on ``device`` (never for fake tensors)."""
        if fake or self.fused_tiles == "0":
            return False
        return self.fused_tiles == "1" or device.type == "cuda"

    def whole_pass_allowed(self, device: torch.device) -> bool:
        """Whether a call on ``device`` may run each pass as one compiled graph (if its shapes allow it)."""
        return self.whole_pass == "1" or (self.whole_pass == "auto" and device.type == "cuda")


def head_settings() -> HeadSettings:
    """The switches as the environment sets them now; a bad value raises ``ValueError`` naming the variable."""
    return _checked(os.environ.get(FUSED_TILES_ENV, "auto"), os.environ.get(WHOLE_PASS_ENV, "auto"))


@functools.lru_cache(maxsize=16)
def _checked(fused_tiles: str, whole_pass: str) -> HeadSettings:
    for name, value in ((FUSED_TILES_ENV, fused_tiles), (WHOLE_PASS_ENV, whole_pass)):
        if value not in MODES:
            raise ValueError(f"{name} must be one of {MODES}, got {value!r}")
    return HeadSettings(fused_tiles, whole_pass)

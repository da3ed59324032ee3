"""Every seed of the pack from one place: (base seed, rank, step, sample index, stream).

Seeds derived here differ across ranks (two DDP ranks never draw the same noise), across steps and
across samples, and are the same whatever the micro-batch split, the resume point or the retry: a
sample's randomness is a function of what it is, not of when or with whom it ran. numpy's
``SeedSequence`` does the mixing (it is built for exactly this: independent streams from a key).
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

__all__ = ["derive_seed", "generator_for"]


def derive_seed(base: int, *, rank: int = 0, step: int = 0, index: int = 0, stream: str = "") -> int:
    """A 63-bit seed for ``stream`` (e.g. ``"grade/noise"``) of sample ``index`` at ``step`` on ``rank``.

    Negative ``step`` or ``index`` values (e.g. ``-1`` for validation) are allowed.
    """
    key = [int(rank), int(step), int(index), zlib.crc32(stream.encode())]
    key = [v % 2**64 for v in key]  # SeedSequence takes non-negative integers
    state = np.random.SeedSequence(entropy=int(base) % 2**64, spawn_key=key).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) % (2**63 - 1)


def generator_for(device: torch.device | str, seed: int) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator

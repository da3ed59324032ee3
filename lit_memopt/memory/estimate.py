"""Peak-memory planning, one import away: the names of ``memory.step``, ``memory.search`` and ``memory.blocks``.

The work lives in small modules: ``tracker`` (the one MemTracker subclass), ``batch`` (resizing batches),
``step`` (one training step under the tracker), ``blocks`` (tracing a few decoder blocks and extrapolating),
``allocator`` (what the CUDA caching allocator reserves), ``sharding`` (per-rank numbers for DDP and FSDP2)
and ``search`` (the largest micro-batch that fits). ``lit-memopt estimate`` is ``lit_memopt.cli_estimate``.
"""

from __future__ import annotations

from lit_memopt.memory.batch import resize_batch
from lit_memopt.memory.search import (
    DEFAULT_SAFETY_MARGIN,
    BatchFit,
    initial_micro_batch_from_estimate,
    largest_micro_batch,
    parse_memory_size,
)
from lit_memopt.memory.step import EstimateError, PeakEstimate, estimate_peak, format_bytes
from lit_memopt.memory.tracker import ModuleMemory

__all__ = [
    "DEFAULT_SAFETY_MARGIN",
    "BatchFit",
    "EstimateError",
    "ModuleMemory",
    "PeakEstimate",
    "estimate_peak",
    "format_bytes",
    "initial_micro_batch_from_estimate",
    "largest_micro_batch",
    "parse_memory_size",
    "resize_batch",
]

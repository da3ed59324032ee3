"""Recognise out-of-memory errors from every backend (CUDA, cuDNN, cuBLAS, CPU, MPS, XPU, HIP).

Used by ``OOMRecovery`` and ``MemoryMonitor`` to tell an allocation failure from any other error.
"""

from __future__ import annotations

import re

__all__ = ["is_oom_error", "OOM_MESSAGE_PATTERNS"]

# Messages that PyTorch and its backends raise as a plain ``RuntimeError`` (or an error type that
# is not ``torch.OutOfMemoryError``) when an allocation fails. Matched case-sensitively because the
# backends spell them exactly like this; each is specific enough not to match unrelated errors.
OOM_MESSAGE_PATTERNS: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p)
    for p in (
        r"CUDA out of memory",  # caching allocator (older releases raised RuntimeError)
        r"HIP out of memory",  # ROCm builds
        r"XPU out of memory",  # Intel GPUs
        r"MPS backend out of memory",  # Apple silicon
        r"CUDNN_STATUS_ALLOC_FAILED",  # cuDNN workspace allocation
        r"CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS handle/workspace allocation
        # cuDNN reports a failed workspace allocation in some kernels as NOT_SUPPORTED.
        r"cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
        r"DefaultCPUAllocator: can't allocate memory",  # POSIX CPU allocator (e.g. RLIMIT_AS hit)
        r"DefaultCPUAllocator: not enough memory",  # Windows CPU allocator
    )
)


def is_oom_error(error: BaseException) -> bool:
    """Return whether ``error`` is an out-of-memory error from any device.

    ``torch.OutOfMemoryError`` (what the CUDA caching allocator and ``memory_budget`` raise) and
    Python's ``MemoryError`` are recognised by type first; other errors by the messages the
    backends use (CUDA, HIP, XPU, MPS, cuDNN, cuBLAS, the CPU allocator). An error raised
    ``from`` an OOM (its ``__cause__``) counts as an OOM too, so wrapping does not hide one.

    Args:
        error: the exception to classify.

    Returns:
        ``True`` when the error means an allocation failed.

    Example::

        try:
            loss = model(batch).sum()
        except Exception as e:
            if not is_oom_error(e):
                raise
            ...  # shrink the batch and retry
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _is_oom_single(current):
            return True
        current = current.__cause__
    return False


def _is_oom_single(error: BaseException) -> bool:
    import torch

    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(error, Exception):
        return False  # KeyboardInterrupt, SystemExit: never an OOM
    message = str(error)
    return any(p.search(message) for p in OOM_MESSAGE_PATTERNS)

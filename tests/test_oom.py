"""OOM detection: every backend's out-of-memory error is recognised, nothing else is."""

from __future__ import annotations

import pytest
import torch

from lit_memopt.memory import is_oom_error, memory_budget


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("anything at all"),
        MemoryError(),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)"),
        RuntimeError("HIP out of memory. Tried to allocate 20.00 MiB"),
        RuntimeError("XPU out of memory. Tried to allocate 1.00 GiB"),
        RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1 MB)"),
        RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)"
        ),
        RuntimeError("[enforce fail at alloc_cpu.cpp:81] data. DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes."),
    ],
    ids=lambda e: type(e).__name__ + ":" + str(e)[:24],
)
def test_recognises_oom(error: BaseException) -> None:
    assert is_oom_error(error)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
        RuntimeError("CUDA error: device-side assert triggered"),
        RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"),
        ValueError("out of memory budget config is wrong"),  # mentions memory, is not an OOM
        KeyboardInterrupt(),
    ],
    ids=lambda e: type(e).__name__ + ":" + str(e)[:24],
)
def test_rejects_other_errors(error: BaseException) -> None:
    assert not is_oom_error(error)


def test_oom_wrapped_with_from_is_recognised() -> None:
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except torch.OutOfMemoryError as oom:
            raise RuntimeError("training step failed") from oom
    except RuntimeError as wrapped:
        assert is_oom_error(wrapped)
    # An unrelated error raised while handling an OOM (implicit context) is not itself an OOM.
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except torch.OutOfMemoryError:
            raise ValueError("bad argument")
    except ValueError as other:
        assert not is_oom_error(other)


def test_real_cpu_allocator_failure_is_recognised() -> None:
    # A request no machine can satisfy: the CPU allocator's own error, not a simulated one.
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except Exception as e:  # noqa: BLE001 - the error type is exactly what is under test
        assert is_oom_error(e), repr(e)
    else:  # pragma: no cover - would need 4 EiB of memory
        pytest.fail("allocating 4 EiB succeeded")


def test_simulated_oom_is_recognised() -> None:
    with pytest.raises(torch.OutOfMemoryError) as info, memory_budget(16):
        torch.ones(1024)
    assert is_oom_error(info.value)

"""Argument checks, tile planning and tile casting for the fused LM-head ops (``linear_head.py``).

Everything that decides *how* a head pass runs lives here: which dtype the tile matmuls use
(the ``precision`` choice), how big the tiles are, and how a hidden/weight tile becomes a
logits tile with ``logit_scale``, ``final_logit_softcapping`` and ``temperature`` applied.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from lit_memopt._compat.torch import cpu_has_native_low_precision_matmul
from lit_memopt._compat.torch import is_fake as is_fake_tensor
from lit_memopt.ops._fused_tiles import chain_to_raw, transform_logits

ChunkSize = Optional[Union[int, Sequence[int]]]
PRECISIONS = ("auto", "exact", "fast")

# Automatic tiling keeps every temporary (a logits tile, an fp32 weight tile, an fp32 hidden tile)
# at most this many elements, but never less than the floor: tiny problems then run in one tile.
MAX_TILE_ELEMENTS = 1 << 23  # 32 MiB in fp32
MIN_TILE_ELEMENTS = 1 << 18
# On CUDA the smallest automatic tile is the CPU's cap (32 MiB in fp32): a GPU pass over small shapes is bound by
# the host work per tile (0.35-0.5 ms: slicing, launches, and two calls of compiled tile kernels at about 60 us
# each, guards or not), not by its matmuls. On an H200 at N=2048, H=512, V=32000
# (benchmarks/results/tile_sweep_cuda_nvidia_h200.md) bf16 "fast" log-probs took 13.6 / 5.0 / 3.5 / 2.6 ms with
# vocabulary tiles of 1024 / 4096 / 8192 / 16384 (Cut Cross-Entropy 2.7 ms, full logits 1.3 ms and 0.70 GiB).
# This floor picks 8192 there (0.14 GiB) and 4096 for fp32 "exact" (96 MiB), where wider tiles gain 6-8%;
# the next doubling would buy "fast" 25% for twice the memory.
CUDA_MIN_TILE_ELEMENTS = 1 << 23
# Compiled tile kernels on CUDA (ops/_fused_tiles.py) need fewer tile buffers: their tiles may be this much larger.
FUSED_CUDA_TILE_SCALE = 2
# Tiles bigger than this are rounded down to a multiple of it, which matmul kernels prefer.
TILE_ALIGN = 128
# On CUDA no tile may take more than this fraction of the currently free memory.
CUDA_FREE_FRACTION = 16
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# exp(x) is computed as exp2(x * log2(e)): torch's vectorized exp2 takes about half the time of
# its exp on x86 CPUs (measured: 0.75 vs 1.6 ms per 1M fp32 elements, one thread, multiply
# included), and the two exponentials per logit are the largest cost of a tile after its matmuls.
LOG2_E = 1.0 / math.log(2.0)


# --------------------------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------------------------


def is_fake(t: Tensor) -> bool:
    """Fake and meta tensors carry no values, so value checks and data-dependent shapes are skipped."""
    if t.device.type == "meta":
        return True
    return is_fake_tensor(t)


def check_float(name: str, t: object, min_dim: int) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor (float16/bfloat16/float32/float64), got {t.dtype}")
    if t.dim() < min_dim:
        raise ValueError(f"`{name}` must have at least {min_dim} dimension(s), got shape {tuple(t.shape)}")
    return t


def check_same_device(reference: Tensor, **tensors: Optional[Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != reference.device:
            raise ValueError(f"`{name}` is on {t.device} but `hidden` is on {reference.device}; move them to one device")


def check_weight_pair(hidden_name: str, hidden: Tensor, weight_name: str, weight: Tensor) -> None:
    check_float(hidden_name, hidden, 1)
    check_float(weight_name, weight, 2)
    if weight.dim() != 2:
        raise ValueError(f"`{weight_name}` must be 2-D [vocab, hidden], got shape {tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise ValueError(f"`{weight_name}` must have at least one vocabulary row, got shape {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"`{weight_name}` has hidden size {weight.shape[1]} but `{hidden_name}` has {hidden.shape[-1]} "
            f"(shapes {tuple(weight.shape)} and {tuple(hidden.shape)}); expected {weight_name}[V, H] and {hidden_name}[..., H]"
        )


def check_bias(name: str, bias: Optional[Tensor], vocab: int) -> None:
    if bias is None:
        return
    check_float(name, bias, 1)
    if bias.shape != (vocab,):
        raise ValueError(f"`{name}` must have shape ({vocab},) to match the head weight, got {tuple(bias.shape)}")


def check_positive(name: str, value: object, *, allow_none: bool = False) -> Optional[float]:
    """A finite number > 0 (a one-element tensor is accepted); ``None`` where ``allow_none``."""
    if value is None and allow_none:
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"`{name}` must be a positive scalar, got a tensor of shape {tuple(value.shape)}")
        value = float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a positive float{' or None' if allow_none else ''}, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be a finite number > 0{' or None' if allow_none else ''}, got {value}")
    return float(value)


def check_targets(targets: object, hidden: Tensor) -> Tensor:
    """Type, shape and device of ``targets``; their values are checked by :func:`targets_out_of_range`
    in the same host sync as the head's other data-dependent decisions."""
    if not isinstance(targets, Tensor):
        raise TypeError(f"`targets` must be a torch.Tensor of token ids, got {type(targets).__name__}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"`targets` must be an integer tensor (e.g. torch.long), got {targets.dtype}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"`targets` must have shape {tuple(hidden.shape[:-1])} (the leading dims of `hidden` {tuple(hidden.shape)}), "
            f"got {tuple(targets.shape)}"
        )
    if targets.device != hidden.device:
        raise ValueError(f"`targets` is on {targets.device} but `hidden` is on {hidden.device}; move them to one device")
    return targets


def targets_out_of_range(targets: Tensor, vocab: int, ignore_index: int) -> Tensor:
    """Bool per target: outside ``[0, vocab)`` and not ``ignore_index`` (computed on the device, no sync)."""
    return (targets != ignore_index) & ((targets < 0) | (targets >= vocab))


def target_range_error(targets: Tensor, vocab: int, ignore_index: int) -> ValueError:
    """The error for targets outside the vocabulary, naming the first one."""
    first = targets[targets_out_of_range(targets, vocab, ignore_index)].flatten()[0].item()
    return ValueError(f"`targets` must be in [0, {vocab}) or equal ignore_index={ignore_index}; found {first}")


def counted_row_indices(valid: Tensor, count: int) -> Tensor:
    """Indices of the ``count`` True entries of the 1-D ``valid``, without a second host sync where torch can."""
    try:
        return torch.nonzero_static(valid, size=count).squeeze(1)
    except torch.OutOfMemoryError:
        raise
    except (NotImplementedError, RuntimeError):  # a torch without a nonzero_static kernel for this device
        return valid.nonzero().squeeze(1)


def check_mask(mask: object, hidden: Tensor) -> Optional[Tensor]:
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"`mask` must be a bool (or 0/1 integer) tensor marking the rows that count, got {getattr(mask, 'dtype', type(mask).__name__)}")
    if mask.shape != hidden.shape[:-1]:
        raise ValueError(f"`mask` must have shape {tuple(hidden.shape[:-1])} (the leading dims of `hidden`), got {tuple(mask.shape)}")
    if mask.device != hidden.device:
        raise ValueError(f"`mask` is on {mask.device} but `hidden` is on {hidden.device}; move them to one device")
    return mask.bool()


def exp_(x: Tensor) -> Tensor:
    """``exp(x)`` in place, through ``exp2`` (see :data:`LOG2_E`); the relative error stays within
    a few fp32 ulps for the exponents a softmax meets (``x <= 0``)."""
    return x.mul_(LOG2_E).exp2_()


# --------------------------------------------------------------------------------------------
# planning: precision and tile sizes
# --------------------------------------------------------------------------------------------


def resolve_precision(precision: object, *tensors: Optional[Tensor]) -> Optional[torch.dtype]:
    """The low-precision dtype the tile matmuls run in (``"fast"``), or ``None`` for fp32 tiles (``"exact"``).

    ``"auto"`` picks ``"fast"`` when every head tensor is bf16 (or every one fp16) and the device
    multiplies that dtype natively: on CUDA the tile product then accumulates into fp32 logits at
    tensor-core speed (``torch.mm(..., out_dtype=float32)``); on a CPU with bf16/fp16 matrix
    instructions (AVX512-BF16, AMX) the tile comes out in the inputs' dtype, i.e. logits rounded to
    bf16 exactly as every full-logits implementation in bf16 rounds them, with the softmax
    statistics kept in fp32. Where the device has no such instructions (an AVX2-only CPU) it picks
    ``"exact"``: emulated bf16 matmuls are far slower than fp32 ones there (one thread of an AVX2
    AMD EPYC: 7.7 s against 0.054 s for a 2048 x 512 x 2048 product), and fp32 tiles are also exact.

    Under autocast to bf16/fp16 (Lightning's ``"bf16-mixed"``: fp32 weights, fp32 or bf16 hidden states)
    the caller has asked for low-precision matmuls, and a plain ``lm_head`` would run in that dtype:
    ``"auto"`` and ``"fast"`` then multiply tiles cast to the autocast dtype on the same terms (fp32 softmax
    statistics, gradients in the inputs' dtypes). Otherwise fp32 or mixed inputs get fp32 tiles.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"`precision` must be one of {PRECISIONS}, got {precision!r}")
    present = [t for t in tensors if t is not None]
    dtypes = {t.dtype for t in present}
    if precision == "exact" or not present:
        return None
    low = next(iter(dtypes)) if len(dtypes) == 1 and next(iter(dtypes)) in _LOW_PRECISION else None
    if low is None:
        autocast = autocast_low_precision(present[0].device)
        if autocast is not None and dtypes <= {autocast, torch.float32}:
            low = autocast
    if low is None:
        return None
    if precision == "fast" or is_fake(present[0]):  # an estimate models the GPU run it sizes
        return low
    return low if native_low_precision_matmul(present[0].device, low) else None


def autocast_low_precision(device: torch.device) -> Optional[torch.dtype]:
    """The bf16/fp16 dtype autocast runs matmuls in on ``device`` now, or ``None`` (off, or another dtype)."""
    kind = device.type
    if kind not in ("cpu", "cuda", "xpu", "mps", "hpu") or not torch.is_autocast_enabled(kind):
        return None
    dtype = torch.get_autocast_dtype(kind)
    return dtype if dtype in _LOW_PRECISION else None


@functools.lru_cache(maxsize=None)
def native_low_precision_matmul(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``device`` multiplies ``dtype`` (bf16/fp16) matrices in hardware rather than by emulation."""
    try:
        if device.type == "cpu":
            return cpu_has_native_low_precision_matmul(dtype)
        if device.type == "cuda" and dtype == torch.bfloat16:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except (AttributeError, RuntimeError, TypeError):
        pass  # a torch without these queries: keep "fast", as before they existed
    return True


def tile_starts(start: int, stop: int, step: int, *, values: bool = True) -> Sequence[int]:
    """Starts of the tiles that cover ``[start, stop)``.

    ``values=False`` (fake tensors: shapes only, nothing to compute) keeps the first two tiles and the last:
    every interior tile allocates and frees exactly what the second one does (accumulators are allocated
    before the loops), so these three leave the same memory trace as all of them, and the peak-memory
    estimate of a 150k-vocabulary head runs a few dozen ops instead of thousands.
    """
    starts = range(start, stop, step)
    if values or len(starts) <= 3:
        return starts
    return (starts[0], starts[1], starts[-1])


def tile_sizes(chunk_size: ChunkSize, rows: int, hidden_size: int, vocab: int, device: torch.device,
               *, fast: bool = False, total_rows: Optional[int] = None, fused: bool = False,
               weight_copied: bool = False) -> tuple[int, int]:
    """Pick ``(row_tile, vocab_tile)``: explicit when given, else from the shapes and free memory.

    ``rows`` are the rows that reach the matmuls; ``total_rows`` (default: ``rows``) all rows of the
    call, masked ones included. The budget is the one for ``total_rows`` scaled by the share of rows
    that count, down to the device's floor, so that on a CPU masking 75% of the rows shrinks the
    tiles 4x even where the unmasked budget is capped: memory falls in proportion to the work. On
    CUDA the floor (``CUDA_MIN_TILE_ELEMENTS``) usually binds: a masked call keeps floor-sized tiles
    and its time falls with its rows instead.

    With ``fast`` (low-precision tile matmuls) vocabulary tiles may be twice as wide, up to the
    same cap: each tile's hidden-gradient product is rounded to bf16/fp16 before it is added in
    fp32, so fewer, wider tiles mean fewer roundings (at N=2048, H=512, V=32000 the hidden
    gradient's error then equals a full-logits implementation's), and the weight tile, already
    in the matmul dtype, needs no copy.

    With ``fused`` (compiled tile kernels) on CUDA the cap on both budgets doubles: those kernels keep
    no tile-sized scratch buffers besides the logits tile, and a GPU pass is bound by the Python work
    per tile, so fewer, larger tiles are faster for the same memory. For the same reason a CUDA
    budget is never below ``CUDA_MIN_TILE_ELEMENTS`` (before the masked-rows share), where a CPU's
    follows ``hidden`` down to ``MIN_TILE_ELEMENTS``.
    """
    if chunk_size is not None:
        if isinstance(chunk_size, int) and not isinstance(chunk_size, bool):
            row_tile = vocab_tile = chunk_size
        elif isinstance(chunk_size, Sequence) and len(chunk_size) == 2 and all(
            isinstance(c, int) and not isinstance(c, bool) for c in chunk_size
        ):
            row_tile, vocab_tile = chunk_size
        else:
            raise TypeError(
                f"`chunk_size` must be None (automatic), an int, or a (row_tile, vocab_tile) pair of ints, got {chunk_size!r}"
            )
        if row_tile < 1 or vocab_tile < 1:
            raise ValueError(f"`chunk_size` entries must be >= 1, got {chunk_size!r}")
        return row_tile, vocab_tile

    # Budget: about the size of `hidden` itself, clamped to a fixed window so that huge batches
    # still tile finely and tiny ones run in a single tile.
    total = rows if total_rows is None else max(total_rows, rows)
    on_cuda = device.type == "cuda"
    cap = MAX_TILE_ELEMENTS * (FUSED_CUDA_TILE_SCALE if fused and on_cuda else 1)
    floor = CUDA_MIN_TILE_ELEMENTS if on_cuda else MIN_TILE_ELEMENTS
    budget = min(max(total * hidden_size, floor), cap)
    vocab_budget = min(2 * budget, cap) if fast else budget
    if total > rows:
        # The floor holds after the share too: below it a GPU pass is bound by its host work per tile
        # (75% of the rows masked at N=512, H=1536, V=151936 on an H100: 29.8 ms with tiles a quarter of
        # the floor, against 8.8 ms for the whole unmasked call), and a CPU's floor is already tiny.
        share = rows / total
        budget, vocab_budget = (max(int(b * share), floor) for b in (budget, vocab_budget))
    if on_cuda and torch.cuda.is_available():
        try:
            free_bytes, _ = torch.cuda.mem_get_info(device)
            cuda_cap = max(free_bytes // (4 * CUDA_FREE_FRACTION), 1 << 14)
            budget, vocab_budget = min(budget, cuda_cap), min(vocab_budget, cuda_cap)
        except RuntimeError:  # fake/meta device contexts cannot query the allocator
            pass

    def align(n: int) -> int:
        return n if n <= TILE_ALIGN else n - n % TILE_ALIGN

    row_tile = align(max(1, min(rows, budget // hidden_size)))
    # A vocab tile is bounded as a logits tile [row_tile, vocab_tile], and as a weight tile [vocab_tile, H]
    # where one exists: a copy of the weight tile in the matmul dtype ("exact" with low-precision weights,
    # or ``weight_copied``: "fast" under autocast with fp32 weights) or an fp32 weight-gradient accumulator
    # (several row tiles). With "fast" and all rows in one row tile, the weight tiles are views and each
    # weight-gradient tile is one product written straight into the gradient (_head_passes._backward_tiles),
    # so only the logits tile bounds it.
    weight_tile_free = fast and not weight_copied and rows <= row_tile
    vocab_tile = align(max(1, min(vocab, vocab_budget // max(row_tile, 1),
                                  vocab if weight_tile_free else vocab_budget // hidden_size)))
    return max(row_tile, 1), max(vocab_tile, 1)


@dataclass(frozen=True)
class LogitTransform:
    """``z = softcap(raw * logit_scale) / temperature`` with ``softcap(s) = cap * tanh(s / cap)``,
    where ``raw = hidden @ weight.T + bias``. Scaling is applied to fp32 logits tiles, never to a
    low-precision weight tile (which would round ``W * scale`` to bf16)."""

    logit_scale: float = 1.0
    softcap: Optional[float] = None
    inv_temperature: float = 1.0

    @property
    def linear_scale(self) -> float:
        """``dz/draw`` when there is no softcap (the whole transform is one multiplication)."""
        return self.logit_scale * self.inv_temperature

    def apply_(self, raw: Tensor) -> Tensor:
        """Turn a raw logits tile into ``z`` in place."""
        return transform_logits(raw, self.softcap, self.logit_scale, self.inv_temperature, out=raw)

    def chain_(self, grad_z: Tensor, z: Optional[Tensor], scratch: Optional[Tensor]) -> Tensor:
        """``d/draw`` from ``d/dz`` in place; ``z`` (the unmodified logits tile) is needed with a softcap."""
        return chain_to_raw(grad_z, z, self.softcap, self.linear_scale, self.inv_temperature, out=grad_z, scratch=scratch)


# --------------------------------------------------------------------------------------------
# low-precision operands into fp32 results (CUDA)
# --------------------------------------------------------------------------------------------

# Whether this torch writes ``mm``/``addmm`` with ``out_dtype`` straight into an fp32 ``out=``
# (no temporary, no copy); learnt at the first call and kept. Older builds only return a new tensor.
_FP32_OUT_IN_PLACE: dict[str, bool] = {}


@functools.lru_cache(maxsize=None)
def cuda_fp32_products() -> bool:
    """Whether this torch multiplies bf16/fp16 operands into fp32 results (``mm(..., out_dtype=)``, torch >= 2.9).

    Without it ``"fast"`` on CUDA rounds each logits tile to the inputs' dtype, as on the CPU."""
    a = torch.empty(2, 2, dtype=torch.bfloat16, device="meta")
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _in_place(kind: str, direct: Callable[[], object], fallback: Callable[[], object]) -> None:
    if _FP32_OUT_IN_PLACE.get(kind, True):
        try:
            direct()
            _FP32_OUT_IN_PLACE[kind] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            if kind in _FP32_OUT_IN_PLACE:  # it worked before: this failure is a real one
                raise
            _FP32_OUT_IN_PLACE[kind] = False
    fallback()


def mm_fp32(a: Tensor, b: Tensor, out: Tensor) -> None:
    """``out = a @ b`` for bf16/fp16 ``a``, ``b`` and fp32 ``out``, accumulated in fp32 (tensor cores)."""
    _in_place("mm", lambda: torch.mm(a, b, out_dtype=torch.float32, out=out),
              lambda: out.copy_(torch.mm(a, b, out_dtype=torch.float32)))


def addmm_fp32_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` for bf16/fp16 ``a``, ``b`` and an fp32 accumulator, without rounding the product."""
    _in_place("addmm", lambda: torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc),
              lambda: acc.add_(torch.mm(a, b, out_dtype=torch.float32)))


# --------------------------------------------------------------------------------------------
# tiles
# --------------------------------------------------------------------------------------------


class TileWorkspace:
    """Tile buffers allocated once per pass and reused by every tile.

    Allocating a fresh multi-megabyte tile per step costs page faults on the CPU and allocator
    traffic on CUDA; reusing flat buffers (viewed to each tile's shape) avoids both.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, rows: int, cols: int, capacity: int, dtype: torch.dtype) -> Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < rows * cols:
            buf = self._buffers[name] = torch.empty(max(capacity, rows * cols), dtype=dtype, device=self.device)
        return buf[: rows * cols].view(rows, cols)


class TileMath:
    """Casting and matmuls of one pass: operand tiles in ``matmul_dtype`` and logits, statistics and
    gradient accumulators in ``stat_dtype`` (fp32, float64 for float64 inputs)."""

    def __init__(self, stat_dtype: torch.dtype, matmul_dtype: torch.dtype, device: torch.device,
                 transform: LogitTransform, row_tile: int, vocab_tile: int, rows: int, vocab: int, *, fused: bool = False) -> None:
        self.stat_dtype, self.matmul_dtype, self.transform = stat_dtype, matmul_dtype, transform
        # The tile softmax maths run as compiled kernels (ops/_fused_tiles.py) instead of eager ops.
        self.fused = fused
        self.ws = TileWorkspace(device)
        self.row_tile, self.vocab_tile = row_tile, vocab_tile
        self.logits_capacity = min(row_tile, max(rows, 1)) * min(vocab_tile, vocab)
        self.fast = matmul_dtype != stat_dtype
        # CUDA multiplies bf16/fp16 operands into fp32 outputs directly (tensor cores, fp32 accumulation).
        self.fp32_out = self.fast and device.type == "cuda" and cuda_fp32_products()

    def operand(self, name: str, src: Tensor, capacity_rows: int) -> Tensor:
        """``src`` in the matmul dtype; a view (no copy) when it already is."""
        if src.dtype == self.matmul_dtype:
            return src
        out = self.ws.get(name, src.shape[0], src.shape[1], capacity_rows * src.shape[1], self.matmul_dtype)
        return out.copy_(src)

    def stat_buffer(self, name: str, rows: int, cols: int) -> Tensor:
        return self.ws.get(name, rows, cols, self.logits_capacity, self.stat_dtype)

    def logits(self, name: str, h: Tensor, w: Tensor, bias: Optional[Tensor], v0: int, v1: int,
               out: Optional[Tensor] = None) -> Tensor:
        """The transformed logits tile ``z`` of rows ``h`` and vocabulary rows ``w`` = ``W[v0:v1]``; written into
        ``out`` when given (a column slice of a whole-vocabulary block, ``_forward_grads.py``), else a tile buffer."""
        rows, cols = h.shape[0], w.shape[0]
        out = self.stat_buffer(name, rows, cols) if out is None else out
        if not self.fast:
            torch.mm(h, w.t(), out=out)
        elif self.fp32_out:
            mm_fp32(h, w.t(), out)
        else:
            low = self.ws.get(name + "_low", rows, cols, self.logits_capacity, self.matmul_dtype)
            out.copy_(torch.mm(h, w.t(), out=low))
        if bias is not None:
            out.add_(bias[v0:v1])  # added in the statistics dtype: no bf16 rounding of the sum
        return self.transform.apply_(out)

    def grad_operand(self, grad_logits: Tensor) -> Tensor:
        """A logit-gradient tile as a matmul operand (cast once, used for both the hidden and weight products)."""
        if not self.fast:
            return grad_logits
        low = self.ws.get("grad_low", grad_logits.shape[0], grad_logits.shape[1], self.logits_capacity, self.matmul_dtype)
        return low.copy_(grad_logits)

    def accumulate(self, name: str, acc: Tensor, a: Tensor, b: Tensor, *, overwrite: bool) -> None:
        """``acc (+)= a @ b`` for operands ``a``, ``b`` in the matmul dtype and ``acc`` in the statistics dtype."""
        if not self.fast:
            if overwrite:
                torch.mm(a, b, out=acc)
            else:
                acc.addmm_(a, b)
            return
        if self.fp32_out:
            if overwrite:
                mm_fp32(a, b, acc)
            else:
                addmm_fp32_(acc, a, b)
            return
        product = torch.mm(a, b, out=self.ws.get(name, acc.shape[0], acc.shape[1], acc.numel(), self.matmul_dtype))
        if overwrite:
            acc.copy_(product)
        else:
            acc.add_(product)

"""TTT-Linear and TTT-MLP sequence layers: projections, the learned inner learning rate, the scan
over mini-batches, and whole-layer / grouped-scan checkpointing (maths in :mod:`.inner`)."""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from lit_memopt.models.ttt.inner import INNER_LN_EPS, linear_step, mlp_step
from lit_memopt.models.ttt.planning import auto_checkpoint_group_size, check_group_size
from lit_memopt.models.ttt.recompute import Recomputed, recompute_in_backward

__all__ = ["LAYER_TYPES", "TTTLayer", "TTTLinear", "TTTMLP", "ttt_layer_class", "resolve_inner_base_lr"]

LAYER_TYPES = ("linear", "mlp")


class TTTLayer(nn.Module):
    """Shared parts of TTT-Linear and TTT-MLP: projections, learned inner learning rate, the scan.

    Subclasses name their inner-model parameters (``_inner_names``), the paper's ``base_lr``
    (``paper_base_lr``), and implement ``_step_inputs``, ``_mini_batch_step`` and
    ``_saved_floats_per_mini_batch``. Arguments: see :class:`TTTLinear`.
    """

    # names of the inner-model parameters, in the order the per-mini-batch step takes them
    _inner_names: ClassVar[tuple[str, ...]] = ()
    # eta_base the paper uses for this kind of inner model
    paper_base_lr: ClassVar[float]

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        mini_batch_size: int = 16,
        base_lr: float = 1.0,
        checkpoint_group_size: int | str = 0,
        auto_num_layers: int = 1,
        initializer_range: float = 0.02,
    ) -> None:
        super().__init__()
        if hidden_size <= 0 or num_heads <= 0 or hidden_size % num_heads != 0:
            raise ValueError(
                f"{type(self).__name__}: hidden_size ({hidden_size}) must be a positive multiple of num_heads ({num_heads})."
            )
        if mini_batch_size <= 0:
            raise ValueError(f"{type(self).__name__}: mini_batch_size must be a positive integer, got {mini_batch_size}.")
        if base_lr <= 0:
            raise ValueError(f"{type(self).__name__}: base_lr must be > 0, got {base_lr}.")
        if isinstance(auto_num_layers, bool) or not isinstance(auto_num_layers, int) or auto_num_layers < 1:
            raise ValueError(
                f"{type(self).__name__}: auto_num_layers must be a positive integer (the TTT layers sharing the "
                f"memory budget of checkpoint_group_size='auto'), got {auto_num_layers!r}."
            )
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.mini_batch_size = mini_batch_size
        self.base_lr = float(base_lr)
        self.checkpoint_group_size = check_group_size(checkpoint_group_size)
        self.auto_num_layers = auto_num_layers
        self.last_group_size: int | None = None

        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        # per-head inner learning rate from a learned projection of the token
        self.lr_weight = nn.Parameter(torch.randn(num_heads, hidden_size) * initializer_range)
        self.lr_bias = nn.Parameter(torch.zeros(num_heads))
        # learnable correction of the 1/(i+1) token-index scale
        self.token_scale_offset = nn.Parameter(torch.zeros(mini_batch_size))
        # LayerNorm inside the inner loss (and on the inner model's output), one per head
        self.inner_norm_weight = nn.Parameter(torch.ones(num_heads, self.head_dim))
        self.inner_norm_bias = nn.Parameter(torch.zeros(num_heads, self.head_dim))
        self.post_norm = nn.LayerNorm(hidden_size, eps=1e-6)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(proj.weight, std=initializer_range)

    # -- subclasses --------------------------------------------------------------------------
    def _step_inputs(
        self,
        *,
        q: torch.Tensor,
        k: torch.Tensor,
        eta: torch.Tensor,
        eta_mix: torch.Tensor,
        last: torch.Tensor,
        bias_minus_target: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """The state-independent tensors ``_mini_batch_step`` takes, for all mini-batches at once.

        All are ``[batch * heads, n, ...]``: queries and keys ``[.., m, d]``, ``eta = E [.., m, m]``,
        ``eta_mix = E * Q K^T + E``, ``last`` (the last row of ``E``, ``[.., 1, m]``) and the inner
        LayerNorm's ``bias - target``. Mini-batch ``i`` of each is passed to the step in order, after
        the queries (which the step always gets first).
        """
        raise NotImplementedError

    def _mini_batch_step(
        self, state: tuple[torch.Tensor, ...], *inputs: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """One inner step on a mini-batch of ``m`` tokens (all tensors ``[batch * heads, ...]``):
        takes the state, one mini-batch of each of ``_step_inputs`` and the inner LayerNorm weight;
        returns the state after the last token and ``f(q_i; W_i)`` for every token (before the
        output LayerNorm). The maths is in :mod:`lit_memopt.models.ttt.inner`."""
        raise NotImplementedError

    def _saved_floats_per_mini_batch(self, b: int) -> int:
        """Rough count of floats one mini-batch of one head keeps for backward (for ``"auto"``)."""
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------------------------
    # kept as a method for callers that reach it through a layer; see recompute.recompute_in_backward
    recompute_in_backward = staticmethod(recompute_in_backward)

    def inner_parameters(self) -> tuple[torch.Tensor, ...]:
        """The initial inner-model weights ``W0`` (shared by all sequences), as the step takes them."""
        return tuple(getattr(self, name) for name in self._inner_names)

    def token_scale(self, length: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``s_i = max(1/(i+1) + delta_i, 0)`` for the first ``length`` positions of a mini-batch."""
        offset = self.token_scale_offset[:length].to(dtype)
        base = 1.0 / torch.arange(1, length + 1, dtype=dtype, device=offset.device)
        return (base + offset).clamp_min(0.0)

    def inner_lr(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Per-token, per-head inner learning rate ``[B, H, T]`` from the layer input ``x [B, T, C]``."""
        logits = torch.einsum("btc,hc->bht", x.to(dtype), self.lr_weight.to(dtype)) + self.lr_bias.to(dtype)[:, None]
        return self.base_lr * torch.sigmoid(logits) / self.head_dim

    def auto_group_size(
        self,
        num_mini_batches: int,
        batch: int,
        device: torch.device | str = "cpu",
        *,
        available_bytes: int | None = None,
    ) -> int:
        """The group size ``checkpoint_group_size="auto"`` picks for ``batch`` sequences of
        ``num_mini_batches`` full mini-batches: :func:`auto_checkpoint_group_size` with this layer's
        saved bytes per mini-batch, its inner-state bytes (float32) and ``auto_num_layers``.
        ``available_bytes`` overrides the free memory measured on ``device``."""
        per_mb = 4 * batch * self.num_heads * self._saved_floats_per_mini_batch(self.mini_batch_size)
        state = 4 * batch * sum(p.numel() for p in self.inner_parameters())
        return auto_checkpoint_group_size(
            num_mini_batches,
            per_mb,
            state,
            num_layers=self.auto_num_layers,
            device=device,
            available_bytes=available_bytes,
        )

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, input_norm: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``x [B, T, C] -> [B, T, C]``; causal: output ``t`` depends on ``x[:, :t+1]`` only.

        ``input_norm`` (e.g. the block's pre-norm) is applied to ``x`` first: ``layer(x, norm)`` is
        ``layer(norm(x))``, but with checkpointing on, the norm's activations are recomputed too.

        With checkpointing on (a group size > 0 and autograd recording), the whole layer (input
        norm, projections, learning-rate gate, scan, output norm and projection) runs without
        recording a graph and backward keeps only ``x``; backward runs the layer again, recording,
        and back-propagates through it (see the package docstring for what the group size bounds).
        The ops are the same as without checkpointing, so results and gradients are
        bit-identical; the price is one more forward of the layer, plus one more of the scan when
        the group size is below the number of mini-batches. ``input_norm`` is recomputed with the
        layer when it is an ``nn.Module`` (its parameters get their gradients); any other callable
        is applied outside the checkpoint.
        """
        group = self.resolve_group_size(x)
        if group > 0 and torch.is_grad_enabled():
            if input_norm is not None and not isinstance(input_norm, nn.Module):
                x, input_norm = input_norm(x), None
            return recompute_in_backward(lambda t: self.compute(t, group, input_norm), x, (self, input_norm))
        return self.compute(x, group, input_norm)

    def resolve_group_size(self, x: torch.Tensor) -> int:
        """Check ``x [B, T, C]`` and return the group size this call uses (``"auto"`` resolved once
        per call, so that the recomputation in backward uses the same groups)."""
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"{type(self).__name__} expects [batch, seq, {self.hidden_size}], got {tuple(x.shape)}.")
        B, T, _ = x.shape
        n_full = T // self.mini_batch_size
        if not n_full:
            return 0
        if self.checkpoint_group_size == "auto":
            group = self.auto_group_size(n_full, B, x.device)
        else:
            group = int(self.checkpoint_group_size)
        self.last_group_size = group
        return group

    def compute(
        self, x: torch.Tensor, group_size: int, input_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The layer's ops for a resolved ``group_size`` (:meth:`resolve_group_size`), without the
        whole-layer checkpoint: :meth:`forward` wraps this in one, and a caller that recomputes a
        larger piece in backward (a :class:`~lit_memopt.models.ttt.TTTBlock`'s conv + TTT half)
        calls it inside its own. With ``0 < group_size <`` mini-batches the scan is still
        checkpointed in groups."""
        # One op (a view) between the input and its consumers in here (the norm may use it twice),
        # so that their gradients reach ``x`` as one sum whether the layer is recomputed or not:
        # the same additions in the same order, so bit-identical gradients.
        x = x.view_as(x)
        if input_norm is not None:
            x = input_norm(x)
        B, T, _ = x.shape
        H, d, b = self.num_heads, self.head_dim, self.mini_batch_size

        # Batch and heads are merged into one leading dim so every product is a plain 3-D bmm
        # (cheaper than 4-D matmul eagerly, and far cheaper under fake tensors).
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(B, T, H, d).transpose(1, 2).reshape(B * H, T, d)

        def per_head(p: torch.Tensor) -> torch.Tensor:
            return p.unsqueeze(0).expand(B, *p.shape).reshape(B * H, *p.shape[1:])

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        # The inner loop accumulates weight updates over the whole sequence: run it in (at least)
        # float32 even under bf16 autocast (the projections above and below still use autocast).
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            lr = self.inner_lr(x, dtype).reshape(B * H, T)
            norm = (per_head(self.inner_norm_weight.to(dtype)[:, None]), per_head(self.inner_norm_bias.to(dtype)[:, None]))
            state = tuple(per_head(p.to(dtype)) for p in self.inner_parameters())
            n_full, rem = divmod(T, b)
            outputs: list[torch.Tensor] = []
            if n_full:
                cut = n_full * b

                def mini_batches(t: torch.Tensor) -> torch.Tensor:
                    return t[:, :cut].reshape(B * H, n_full, b, *t.shape[2:])

                state, out = self._scan(
                    state, (mini_batches(q), mini_batches(k), mini_batches(v), mini_batches(lr)), norm, group_size
                )
                outputs.append(out.reshape(B * H, cut, d))
            if rem:
                # the remainder is one shorter mini-batch that starts from the last full state
                tail = tuple(t[:, T - rem :].unsqueeze(1) for t in (q, k, v, lr))
                state, out = self._scan(state, tail, norm, group=0)
                outputs.append(out.reshape(B * H, rem, d))
            out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        out = out.reshape(B, H, T, d).transpose(1, 2).reshape(B, T, self.hidden_size).to(x.dtype)
        return self.o_proj(self.post_norm(out))

    def _scan(
        self,
        state: tuple[torch.Tensor, ...],
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        norm: tuple[torch.Tensor, torch.Tensor],
        group: int,
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Step through mini-batches ``inputs[i][:, j]`` (each ``[BH, m, ...]``) in order.

        With ``0 < group < n`` (and autograd recording), every ``group`` consecutive mini-batches
        run inside one non-reentrant checkpoint: backward keeps only the states between groups.
        """
        q, k, v, lr = inputs
        n, m, d = q.shape[1], q.shape[2], q.shape[3]
        n_state = len(state)
        norm_w, norm_b = norm
        # Everything that does not depend on the inner state, for all mini-batches at once (one op
        # each instead of one per mini-batch), outside the checkpointed groups so that the graph,
        # and the gradients bit for bit, do not depend on the group size.
        eta = torch.tril(self.token_scale(m, lr.dtype)[:, None] * lr.unsqueeze(-2))  # E [BH, n, m, m]
        per_mini_batch = self._step_inputs(
            q=q,
            k=k,
            eta=eta,
            eta_mix=torch.addcmul(eta, eta, torch.matmul(q, k.transpose(-1, -2))),  # E * Q K^T + E
            last=eta[:, :, -1:, :],  # [BH, n, 1, m]: the last token's row gives the next state
            bias_minus_target=norm_b.unsqueeze(1) - (v - k),  # target v - k (reconstruction)
        )
        # The LayerNorm weight expanded over mini-batches and handed to each step like the tensors
        # above: its gradient is stacked per mini-batch and summed over them by one reduction, in
        # the same order with or without group checkpointing (bit-identical gradients).
        weights = norm_w.unsqueeze(1).expand(-1, n, -1, -1)

        def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            st = tuple(tensors[:n_state])
            outs = []
            # unbind, not t[:, i]: its backward stacks the mini-batch gradients once, where one
            # select per mini-batch would write a full-size zero gradient each (quadratic in n)
            for q_i, weight, *step_i in zip(*(t.unbind(1) for t in tensors[n_state:])):
                st, z_bar = self._mini_batch_step(st, q_i, *step_i, weight)
                # output rule o_i = q_i + LN(z_bar_i); the LayerNorm bias is added once, below
                outs.append(torch.addcmul(q_i, F.layer_norm(z_bar, (d,), eps=INNER_LN_EPS), weight))
            return (*st, torch.stack(outs, dim=1))

        grouped = 0 < group < n and torch.is_grad_enabled()
        step = group if grouped else n
        outputs = []
        # split (one backward for all groups), not t[:, a:b] (a full-size zero gradient per group)
        for group_inputs in zip(*(t.split(step, dim=1) for t in (q, weights, *per_mini_batch))):
            args = (*state, *group_inputs)
            result = Recomputed.apply(run, len(args), *args) if grouped else run(*args)
            state = tuple(result[:n_state])
            outputs.append(result[n_state])
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        return state, out + norm_b.unsqueeze(1)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, mini_batch_size={self.mini_batch_size}, "
            f"base_lr={self.base_lr}, checkpoint_group_size={self.checkpoint_group_size!r}"
        )


class TTTLinear(TTTLayer):
    """TTT layer whose hidden state is a linear model ``f(x) = x W + b`` per head (TTT-Linear).

    Args:
        hidden_size: model width ``C``; split into ``num_heads`` heads of ``C / num_heads``.
        num_heads: independent inner models.
        mini_batch_size: tokens per inner gradient step ``b`` (the paper uses 16).
        base_lr: ``eta_base`` of the inner learning rate (the paper's value for TTT-Linear is
            :attr:`paper_base_lr`).
        checkpoint_group_size: 0 stores the whole layer's intermediates for backward. ``g > 0``
            checkpoints the layer: backward keeps only its input and recomputes it; with ``g`` at
            least the number of mini-batches ``n`` (e.g. ``seq_len // mini_batch_size``) the
            recomputation is one pass (fastest), with ``g < n`` its scan is checkpointed every ``g``
            mini-batches (least memory, one more scan forward). ``"auto"`` picks 0, ``n`` or the
            memory-minimum ``g`` from the free memory (:func:`auto_checkpoint_group_size`,
            :meth:`auto_group_size`).
        auto_num_layers: how many TTT layers (this one included) keep their scans alive together
            in backward, so share the memory budget of ``"auto"`` (e.g. the model's TTT layers).
        initializer_range: std of the normal initialisation of projections and ``W0``.

    Raises:
        ValueError: on a width not divisible by the heads, a non-positive mini-batch size,
            learning rate or ``auto_num_layers``, or a bad ``checkpoint_group_size``.

    Example::

        layer = TTTLinear(256, num_heads=4, mini_batch_size=16, checkpoint_group_size=4)
        y = layer(torch.randn(2, 100, 256))   # 6 full mini-batches + a remainder of 4
    """

    _inner_names = ("W1", "b1")
    paper_base_lr = 1.0

    def __init__(self, hidden_size: int, num_heads: int, **kwargs: Any) -> None:
        super().__init__(hidden_size, num_heads, **kwargs)
        std = kwargs.get("initializer_range", 0.02)
        self.W1 = nn.Parameter(torch.randn(num_heads, self.head_dim, self.head_dim) * std)
        self.b1 = nn.Parameter(torch.zeros(num_heads, 1, self.head_dim))

    def _saved_floats_per_mini_batch(self, b: int) -> int:
        d = self.head_dim
        return 24 * b * d + 3 * b * b + d * d

    def _step_inputs(self, *, q, k, eta, eta_mix, last, bias_minus_target):
        return k, eta_mix, last.transpose(-1, -2), bias_minus_target

    def _mini_batch_step(self, state, *inputs):
        return linear_step(state, *inputs)


class TTTMLP(TTTLayer):
    """TTT layer whose hidden state is a two-layer MLP ``f(x) = GELU(x W1 + b1) W2 + b2`` per head (TTT-MLP).

    Args:
        hidden_size: model width ``C``; split into ``num_heads`` heads.
        num_heads: independent inner models.
        expansion: inner MLP width as a multiple of the head width (paper: 4).
        mini_batch_size, base_lr, checkpoint_group_size, auto_num_layers, initializer_range: as in
            :class:`TTTLinear` (the paper's ``base_lr`` for TTT-MLP is :attr:`paper_base_lr`).

    Raises:
        ValueError: as :class:`TTTLinear`, and for ``expansion < 1``.

    Example::

        layer = TTTMLP(256, num_heads=4, base_lr=0.1, checkpoint_group_size="auto")
        y = layer(torch.randn(2, 64, 256))
    """

    _inner_names = ("W1", "b1", "W2", "b2")
    paper_base_lr = 0.1

    def __init__(self, hidden_size: int, num_heads: int, *, expansion: int = 4, **kwargs: Any) -> None:
        super().__init__(hidden_size, num_heads, **kwargs)
        if expansion < 1:
            raise ValueError(f"TTTMLP: expansion must be >= 1, got {expansion}.")
        std = kwargs.get("initializer_range", 0.02)
        inner = expansion * self.head_dim
        self.expansion = expansion
        self.W1 = nn.Parameter(torch.randn(num_heads, self.head_dim, inner) * std)
        self.b1 = nn.Parameter(torch.zeros(num_heads, 1, inner))
        self.W2 = nn.Parameter(torch.randn(num_heads, inner, self.head_dim) * std)
        self.b2 = nn.Parameter(torch.zeros(num_heads, 1, self.head_dim))

    def _saved_floats_per_mini_batch(self, b: int) -> int:
        d, m = self.head_dim, self.expansion * self.head_dim
        return 16 * b * d + 14 * b * m + 6 * b * b + 2 * d * m

    def _step_inputs(self, *, q, k, eta, eta_mix, last, bias_minus_target):
        return k, eta, eta_mix, last.transpose(-1, -2), bias_minus_target

    def _mini_batch_step(self, state, *inputs):
        return mlp_step(state, *inputs)


def ttt_layer_class(layer_type: str) -> type[TTTLayer]:
    """``"linear"`` -> :class:`TTTLinear`, ``"mlp"`` -> :class:`TTTMLP`."""
    if layer_type == "linear":
        return TTTLinear
    if layer_type == "mlp":
        return TTTMLP
    raise ValueError(f"layer_type={layer_type!r} is not supported; use one of {list(LAYER_TYPES)}.")


def resolve_inner_base_lr(layer_type: str, inner_base_lr: float | None = None) -> float:
    """``inner_base_lr`` as a float, or the paper's ``eta_base`` for ``layer_type`` when it is ``None``
    (``paper_base_lr`` of :class:`TTTLinear` / :class:`TTTMLP`)."""
    if inner_base_lr is not None:
        return float(inner_base_lr)
    return ttt_layer_class(layer_type).paper_base_lr

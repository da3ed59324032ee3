"""Test-time-training (TTT) sequence layers, a small TTT language model, and gated TTT branches for
pretrained transformers causal LMs (Sun et al., "Learning to (Learn at Test Time)", 2024).

A TTT layer keeps a small model ``f(.; W)`` (linear, or a two-layer MLP) as its hidden state and
trains it on the sequence itself with one gradient step per mini-batch of ``b`` tokens. For head
``h`` and a mini-batch with keys ``K``, values ``V`` and queries ``Q`` (rows ``k_j``, ``v_j``, ``q_i``):

* inner loss: ``l_j(W) = 0.5 * || LN(f(k_j; W)) - (v_j - k_j) ||^2`` with a learnable per-head
  LayerNorm ``LN`` (the layer-normalised reconstruction target of the paper);
* per-token inner learning rate: ``lr_j = base_lr * sigmoid(theta_h . x_j + beta_h) / head_dim``
  (a learned projection of the token), scaled by the token-index factor
  ``s_i = max(1 / (i + 1) + delta_i, 0)`` with learnable ``delta``;
* mini-batch update (all gradients taken at the mini-batch's initial state ``W0``):
  ``W_i = W0 - s_i * sum_{j <= i} lr_j * grad l_j(W0)``, output ``o_i = q_i + LN(f(q_i; W_i))``;
  the next mini-batch starts from ``W_b`` (the state after its last token).

The *dual form* computes all ``o_i`` of a mini-batch with matrix products and never materialises
the per-token ``W_i``: with ``G = dl/dZ`` at ``W0`` and ``E[i, j] = s_i * lr_j`` for ``j <= i`` (else 0),
``Z_bar = Q W0 - (E * Q K^T) G + b0 - E G``. Both forms give the same result; the tests check it
against a primal reference that steps the inner model with autograd.

Memory: the scan over mini-batches stores each mini-batch's intermediates for backward (the
44 GB-vs-20 GB problem of naive TTT training). With ``checkpoint_group_size=g > 0`` the whole layer
(input norm, projections, learning-rate gate, the scan, output norm and projection) runs without
recording a graph and backward keeps only its input; when backward reaches the layer it runs it
again, recording, and back-propagates through that. The recomputation is bounded by ``g``: with
``g`` smaller than the number of mini-batches ``n``, the recomputed scan is itself checkpointed
every ``g`` mini-batches (non-reentrant ``torch.utils.checkpoint``), so at most ``g`` mini-batches'
intermediates are alive at once, for one more scan forward; with ``g >= n`` the layer is recomputed
in one pass (fastest; one layer's scan intermediates alive while its backward runs). In a
:class:`TTTBlock` the causal convolution before the layer is recomputed with it by default
(``TTTConfig.checkpoint_conv``), so the block's whole sequence-mixing half keeps only its input. The
same ops run in the same order, so outputs and gradients are bit-identical to the plain layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "TTTLinear",
    "TTTMLP",
    "TTTConfig",
    "TTTForCausalLM",
    "TTTIntegrationConfig",
    "GatedTTT",
    "AttentionWithTTT",
    "add_ttt_layers",
    "ttt_branches",
    "ttt_layer_class",
    "auto_checkpoint_group_size",
]

LAYER_TYPES = ("linear", "mlp")
_INNER_LN_EPS = 1e-6


# ----------------------------------------------------------------------------------------------
# Inner-loop maths (closed-form gradients, so the dual form needs no nested autograd)
# ----------------------------------------------------------------------------------------------


def _normalize(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z_hat, rstd)`` of a LayerNorm over the last dim. Written as mean / centred square mean:
    ``torch.var_mean`` is several times slower on the CPU for these short rows."""
    centred = z - z.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt((centred * centred).mean(dim=-1, keepdim=True) + _INNER_LN_EPS)
    return centred * rstd, rstd


def _layer_norm_l2_grad(z: torch.Tensor, bias_minus_target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``d/dz 0.5 * ||LN(z) - target||^2`` row by row (LayerNorm's backward written out), for a
    LayerNorm with ``weight`` and ``bias``; takes ``bias - target``, computed once per scan."""
    z_hat, rstd = _normalize(z)
    grad_hat = torch.addcmul(bias_minus_target, z_hat, weight) * weight
    projection = torch.addcmul(grad_hat.mean(dim=-1, keepdim=True), z_hat, (grad_hat * z_hat).mean(dim=-1, keepdim=True))
    return rstd * (grad_hat - projection)


def _gelu_grad(z: torch.Tensor) -> torch.Tensor:
    """Derivative of the exact (erf) GELU: ``Phi(z) + z * phi(z)``."""
    cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + z * pdf


def _available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device``: lit_memopt.memory's snapshot when present, else the backend's own probe."""
    try:
        from lit_memopt.memory import memory_snapshot

        free = getattr(memory_snapshot(device), "free_bytes", None)
        if free is not None:
            return int(free)
    except Exception:  # the memory package is optional here: any failure means "ask the backend"
        pass
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            import psutil

            return int(psutil.virtual_memory().available)
        except ImportError:  # pragma: no cover - psutil is a dependency
            return None
    return None


def auto_checkpoint_group_size(
    num_mini_batches: int,
    mini_batch_bytes: int,
    state_bytes: int,
    *,
    num_layers: int = 1,
    device: torch.device | str = "cpu",
    budget_fraction: float = 0.25,
    available_bytes: int | None = None,
) -> int:
    """Choose the scan's ``checkpoint_group_size`` from the memory available.

    Without checkpointing, backward needs ``num_layers * num_mini_batches * mini_batch_bytes`` of
    saved scan intermediates. If that fits into ``budget_fraction`` of the free memory, return 0
    (no checkpointing: no recomputation).
    Checkpointing keeps only each layer's input for backward and recomputes one layer at a time.
    If one layer's whole scan (``num_mini_batches * mini_batch_bytes``) fits into the budget, return
    ``num_mini_batches``: the layer is recomputed in one pass (the fastest checkpointed setting).
    Otherwise the recomputed scan is itself checkpointed in groups of ``g`` mini-batches: backward
    holds ``n / g`` boundary states plus one group, ``(n / g) * state_bytes + g * mini_batch_bytes``,
    smallest at ``g = sqrt(n * state_bytes / mini_batch_bytes)``; that ``g`` is returned (at least 1).

    Free memory comes from ``lit_memopt.memory.memory_snapshot(device).free_bytes`` when that
    exists, else ``torch.cuda.mem_get_info`` / ``psutil``; when nothing can be measured the
    conservative choice (checkpointing) is made.

    Args:
        num_mini_batches: full mini-batches in the scan of one layer.
        mini_batch_bytes: bytes one mini-batch saves for backward in one layer.
        state_bytes: bytes of one inner state (all heads, whole batch).
        num_layers: TTT layers whose scans are alive together in backward.
        device: where the layer runs.
        budget_fraction: share of the free memory the saved scan may use.
        available_bytes: override the measured free memory (tests, planning).

    Raises:
        ValueError: if a size is negative or ``budget_fraction`` is not in ``(0, 1]``.
    """
    if num_mini_batches < 0 or mini_batch_bytes < 0 or state_bytes < 0 or num_layers < 1:
        raise ValueError(
            "auto_checkpoint_group_size: num_mini_batches, mini_batch_bytes, state_bytes must be >= 0 and "
            f"num_layers >= 1; got {num_mini_batches}, {mini_batch_bytes}, {state_bytes}, {num_layers}."
        )
    if not 0.0 < budget_fraction <= 1.0:
        raise ValueError(f"budget_fraction must be in (0, 1], got {budget_fraction}.")
    if num_mini_batches <= 1:
        return 0
    free = available_bytes if available_bytes is not None else _available_bytes(torch.device(device))
    needed = num_layers * num_mini_batches * mini_batch_bytes
    if free is not None and needed <= budget_fraction * free:
        return 0
    if free is not None and num_mini_batches * mini_batch_bytes <= budget_fraction * free:
        return num_mini_batches
    best = math.sqrt(num_mini_batches * state_bytes / max(mini_batch_bytes, 1))
    return int(min(max(round(best), 1), num_mini_batches))


# ----------------------------------------------------------------------------------------------
# TTT layers
# ----------------------------------------------------------------------------------------------


class _TTTLayer(nn.Module):
    """Shared parts of TTT-Linear and TTT-MLP: projections, learned inner learning rate, the scan."""

    # names of the inner-model parameters, in the order the per-mini-batch step takes them
    _inner_names: tuple[str, ...] = ()

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        mini_batch_size: int = 16,
        base_lr: float = 1.0,
        checkpoint_group_size: int | str = 0,
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
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.mini_batch_size = mini_batch_size
        self.base_lr = float(base_lr)
        self.checkpoint_group_size = _check_group_size(checkpoint_group_size)
        # how many TTT layers share the memory budget when checkpoint_group_size="auto"
        self.auto_num_layers = 1
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
        output LayerNorm)."""
        raise NotImplementedError

    def _saved_floats_per_mini_batch(self, b: int) -> int:
        """Rough count of floats one mini-batch of one head keeps for backward (for ``"auto"``)."""
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------------------------
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

    def _group_size(self, num_mini_batches: int, batch: int, device: torch.device) -> int:
        if self.checkpoint_group_size != "auto":
            return int(self.checkpoint_group_size)
        per_mb = 4 * batch * self.num_heads * self._saved_floats_per_mini_batch(self.mini_batch_size)
        state = 4 * batch * sum(p.numel() for p in self.inner_parameters())
        return auto_checkpoint_group_size(
            num_mini_batches, per_mb, state, num_layers=self.auto_num_layers, device=device
        )

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, input_norm: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``x [B, T, C] -> [B, T, C]``; causal: output ``t`` depends on ``x[:, :t+1]`` only.

        ``input_norm`` (e.g. the block's pre-norm) is applied to ``x`` first: ``layer(x, norm)`` is
        ``layer(norm(x))``, but with checkpointing on, the norm's activations are recomputed too.

        With checkpointing on (a group size > 0 and autograd recording), the whole layer (input
        norm, projections, learning-rate gate, scan, output norm and projection) runs without
        recording a graph and backward keeps only ``x``; backward runs the layer again, recording,
        and back-propagates through it (see the module docstring for what the group size bounds).
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
            return self.recompute_in_backward(
                lambda t: self._layer_forward(t, group, input_norm), x, (self, input_norm)
            )
        return self._layer_forward(x, group, input_norm)

    def resolve_group_size(self, x: torch.Tensor) -> int:
        """Check ``x [B, T, C]`` and return the group size this call uses (``"auto"`` resolved once
        per call, so that the recomputation in backward uses the same groups)."""
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"{type(self).__name__} expects [batch, seq, {self.hidden_size}], got {tuple(x.shape)}.")
        B, T, _ = x.shape
        n_full = T // self.mini_batch_size
        group = self._group_size(n_full, B, x.device) if n_full else 0
        if n_full:
            self.last_group_size = group
        return group

    @staticmethod
    def recompute_in_backward(
        fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, modules: Sequence[nn.Module | None]
    ) -> torch.Tensor:
        """``fn(x)`` with activation checkpointing: nothing but ``x`` is kept for backward, which
        runs ``fn`` again with autograd on and back-propagates through it. ``modules`` are the
        modules ``fn`` uses: their parameters get their gradients. Bit-identical to ``fn(x)``."""
        params = tuple(p for m in modules if m is not None for p in m.parameters() if p.requires_grad)
        if not (x.requires_grad or params):
            return fn(x)
        return _Recomputed.apply(fn, 1, x, *params)

    def _layer_forward(
        self, x: torch.Tensor, group: int, input_norm: Callable[[torch.Tensor], torch.Tensor] | None
    ) -> torch.Tensor:
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
                    state, (mini_batches(q), mini_batches(k), mini_batches(v), mini_batches(lr)), norm, group
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
                outs.append(torch.addcmul(q_i, F.layer_norm(z_bar, (d,), eps=_INNER_LN_EPS), weight))
            return (*st, torch.stack(outs, dim=1))

        grouped = 0 < group < n and torch.is_grad_enabled()
        step = group if grouped else n
        outputs = []
        # split (one backward for all groups), not t[:, a:b] (a full-size zero gradient per group)
        for group_inputs in zip(*(t.split(step, dim=1) for t in (q, weights, *per_mini_batch))):
            args = (*state, *group_inputs)
            result = _Recomputed.apply(run, len(args), *args) if grouped else run(*args)
            state = tuple(result[:n_state])
            outputs.append(result[n_state])
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        return state, out + norm_b.unsqueeze(1)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, mini_batch_size={self.mini_batch_size}, "
            f"base_lr={self.base_lr}, checkpoint_group_size={self.checkpoint_group_size!r}"
        )


def _autocast_state(device_type: str) -> dict[str, Any]:
    """The caller's autocast setting for ``device_type``, to re-enter it in backward."""
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return {"device_type": device_type if torch.amp.is_autocast_available(device_type) else "cpu", "enabled": False}
    return {"device_type": device_type, "dtype": torch.get_autocast_dtype(device_type), "enabled": True}


class _Recomputed(torch.autograd.Function):
    """Activation checkpointing without saved-tensor hooks, for a whole TTT layer (or a block's
    conv + TTT half) and for a group of scan steps.

    ``_Recomputed.apply(fn, num_args, *args, *params)``: forward runs ``fn(*args)`` without
    recording (autograd functions' forwards never record) and saves only ``args``. Backward runs
    ``fn`` again with autograd on (under the forward's autocast setting), then ``torch.autograd.grad``
    of that with the incoming gradients, with respect to ``args`` and ``params`` (the parameters
    ``fn`` uses). The recomputation builds the same graph the plain call builds, so the gradients
    are bit-identical. Compared with ``torch.utils.checkpoint`` this skips a Python hook per saved
    tensor and records nothing in forward. Outputs that get no gradient (an unused final scan
    state) are left out of backward, as without checkpointing.
    """

    @staticmethod
    def forward(ctx, fn: Callable[..., Any], num_args: int, *tensors: torch.Tensor):
        args = tensors[:num_args]
        ctx.fn, ctx.params = fn, tensors[num_args:]
        ctx.autocast = _autocast_state(args[0].device.type)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*args)
        # detached: a view of an input made here would claim to require grad without a grad_fn,
        # which module hooks that watch inputs (e.g. MemTracker's) reject
        return fn(*(a.detach() for a in args))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor | None):
        needs = ctx.needs_input_grad[2:]
        args = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs)]
        with torch.enable_grad(), torch.autocast(**ctx.autocast):
            outputs = ctx.fn(*args)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        inputs = (*args, *ctx.params)
        wanted = [t for t, need in zip(inputs, needs) if need]
        if not pairs or not wanted:
            return (None, None, *(None for _ in inputs))
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        return (None, None, *(next(got) if need else None for need in needs))


def _check_group_size(value: int | str) -> int | str:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"checkpoint_group_size must be 0 (off), a positive number of mini-batches, or 'auto'; got {value!r}."
        )
    return value


class TTTLinear(_TTTLayer):
    """TTT layer whose hidden state is a linear model ``f(x) = x W + b`` per head (TTT-Linear).

    Args:
        hidden_size: model width ``C``; split into ``num_heads`` heads of ``C / num_heads``.
        num_heads: independent inner models.
        mini_batch_size: tokens per inner gradient step ``b`` (the paper uses 16).
        base_lr: ``eta_base`` of the inner learning rate (paper: 1.0 for TTT-Linear).
        checkpoint_group_size: 0 stores the whole layer's intermediates for backward. ``g > 0``
            checkpoints the layer: backward keeps only its input and recomputes it; with ``g`` at
            least the number of mini-batches ``n`` (e.g. ``seq_len // mini_batch_size``) the
            recomputation is one pass (fastest), with ``g < n`` its scan is checkpointed every ``g``
            mini-batches (least memory, one more scan forward). ``"auto"`` picks 0, ``n`` or the
            memory-minimum ``g`` from the free memory (:func:`auto_checkpoint_group_size`).
        initializer_range: std of the normal initialisation of projections and ``W0``.

    Raises:
        ValueError: on a width not divisible by the heads, a non-positive mini-batch size or
            learning rate, or a bad ``checkpoint_group_size``.

    Example::

        layer = TTTLinear(256, num_heads=4, mini_batch_size=16, checkpoint_group_size=4)
        y = layer(torch.randn(2, 100, 256))   # 6 full mini-batches + a remainder of 4
    """

    _inner_names = ("W1", "b1")

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

    def _mini_batch_step(self, state, q, k, eta_mix, last, bias_minus_target, norm_w):
        W, bias = state
        z = torch.baddbmm(bias, k, W)
        grad = _layer_norm_l2_grad(z, bias_minus_target, norm_w)
        # dual form: Z_bar = Q W0 - (E * Q K^T) G + b0 - E G
        z_bar = torch.baddbmm(bias, q, W) - torch.bmm(eta_mix, grad)
        # the state after the last token: W0 - K^T diag(e) G, b0 - sum_j e_j g_j (e: E's last row)
        scaled = last * grad
        W_next = W - torch.bmm(k.transpose(-1, -2), scaled)
        b_next = bias - scaled.sum(dim=-2, keepdim=True)
        return (W_next, b_next), z_bar


class TTTMLP(_TTTLayer):
    """TTT layer whose hidden state is a two-layer MLP ``f(x) = GELU(x W1 + b1) W2 + b2`` per head (TTT-MLP).

    Args:
        hidden_size: model width ``C``; split into ``num_heads`` heads.
        num_heads: independent inner models.
        expansion: inner MLP width as a multiple of the head width (paper: 4).
        mini_batch_size, base_lr, checkpoint_group_size, initializer_range: as in :class:`TTTLinear`
            (the paper uses ``base_lr=0.1`` for TTT-MLP).

    Raises:
        ValueError: as :class:`TTTLinear`, and for ``expansion < 1``.

    Example::

        layer = TTTMLP(256, num_heads=4, base_lr=0.1, checkpoint_group_size="auto")
        y = layer(torch.randn(2, 64, 256))
    """

    _inner_names = ("W1", "b1", "W2", "b2")

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

    def _mini_batch_step(self, state, q, k, eta, eta_mix, last, bias_minus_target, norm_w):
        W1, b1, W2, b2 = state
        z1 = torch.baddbmm(b1, k, W1)
        x2 = F.gelu(z1)
        z2 = torch.baddbmm(b2, x2, W2)
        grad2 = _layer_norm_l2_grad(z2, bias_minus_target, norm_w)
        grad1 = torch.bmm(grad2, W2.transpose(-1, -2)) * _gelu_grad(z1)
        # dual form, layer by layer: the second layer's "keys" are x2, its "queries" x2_bar
        z1_bar = torch.baddbmm(b1, q, W1) - torch.bmm(eta_mix, grad1)
        x2_bar = F.gelu(z1_bar)
        eta_x2 = torch.addcmul(eta, eta, torch.bmm(x2_bar, x2.transpose(-1, -2)))  # E * X2_bar X2^T + E
        z2_bar = torch.baddbmm(b2, x2_bar, W2) - torch.bmm(eta_x2, grad2)
        scaled1, scaled2 = last * grad1, last * grad2  # rows scaled by E's last row
        W1_next = W1 - torch.bmm(k.transpose(-1, -2), scaled1)
        b1_next = b1 - scaled1.sum(dim=-2, keepdim=True)
        W2_next = W2 - torch.bmm(x2.transpose(-1, -2), scaled2)
        b2_next = b2 - scaled2.sum(dim=-2, keepdim=True)
        return (W1_next, b1_next, W2_next, b2_next), z2_bar


def ttt_layer_class(layer_type: str) -> type[_TTTLayer]:
    """``"linear"`` -> :class:`TTTLinear`, ``"mlp"`` -> :class:`TTTMLP`."""
    if layer_type == "linear":
        return TTTLinear
    if layer_type == "mlp":
        return TTTMLP
    raise ValueError(f"layer_type={layer_type!r} is not supported; use one of {list(LAYER_TYPES)}.")


# ----------------------------------------------------------------------------------------------
# The small TTT language model
# ----------------------------------------------------------------------------------------------


@dataclass
class TTTConfig:
    """Architecture of a small TTT language model (blocks of causal conv + TTT layer + SwiGLU MLP).

    Hydra-instantiable like :class:`~lit_memopt.models.ModelConfig`: it is cheap to create;
    ``build_model()`` makes the network and ``build_tokenizer()`` the tokenizer, so the CLI's
    ``model_config.build_tokenizer()`` contract holds.

    Each block is pre-norm: ``x += conv(norm(x))`` (a short causal depthwise convolution that lets
    a token's keys see its predecessors, as in the paper's Mamba backbone; ``conv_kernel=0`` drops
    it), ``x += TTT(norm(x))``, ``x += SwiGLU(norm(x))``. There are no position embeddings: order
    reaches the model through the convolution and the causal inner updates.

    Args:
        name: short name for logs.
        vocab_size: embedding rows (the byte tokenizer needs 384).
        hidden_size: model width.
        num_layers: blocks.
        num_heads: TTT heads per layer.
        intermediate_size: SwiGLU width.
        layer_type: ``linear`` (TTT-Linear) or ``mlp`` (TTT-MLP).
        mini_batch_size: tokens per inner gradient step.
        inner_base_lr: ``eta_base``; ``None`` takes the paper's value (1.0 linear, 0.1 MLP).
        mlp_expansion: TTT-MLP inner width / head width.
        conv_kernel: width of the causal token-mixing convolution (0: none).
        checkpoint_group_size: layer and scan checkpointing, see :class:`TTTLinear` (``"auto"`` accepted).
        checkpoint_conv: when checkpointing is on, recompute each block's causal convolution with its
            TTT layer (the block's whole sequence-mixing half keeps only its input for backward);
            ``False`` stores the convolution's activations and checkpoints the TTT layer alone.
        rms_norm_eps: epsilon of the RMSNorms.
        tie_word_embeddings: share the input embedding with the LM head.
        initializer_range: std of the normal initialisation.
        tokenizer: local tokenizer directory, ``None`` for the byte-level ByT5 tokenizer.
        dtype: parameter dtype: ``float32`` or ``bfloat16``.

    Raises:
        ValueError: on an unknown ``layer_type``/``dtype`` or inconsistent sizes.

    Example::

        config = TTTConfig(hidden_size=128, num_layers=2, num_heads=4, mini_batch_size=8)
        model = config.build_model()
        hidden = model(torch.randint(0, 384, (2, 40)))        # [2, 40, 128]
    """

    name: str = "ttt"
    vocab_size: int = 384
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 352
    layer_type: str = "linear"
    mini_batch_size: int = 16
    inner_base_lr: float | None = None
    mlp_expansion: int = 4
    conv_kernel: int = 4
    checkpoint_group_size: int | str = 0
    checkpoint_conv: bool = True
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    tokenizer: str | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        from lit_memopt.models.hf import resolve_dtype

        ttt_layer_class(self.layer_type)
        resolve_dtype(self.dtype)
        _check_group_size(self.checkpoint_group_size)
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "mini_batch_size"):
            if int(getattr(self, key)) <= 0:
                raise ValueError(f"TTTConfig.{key} must be a positive integer, got {getattr(self, key)!r}.")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"TTTConfig.hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})."
            )
        if self.conv_kernel < 0:
            raise ValueError(f"TTTConfig.conv_kernel must be >= 0, got {self.conv_kernel}.")

    @property
    def torch_dtype(self) -> torch.dtype:
        from lit_memopt.models.hf import resolve_dtype

        return resolve_dtype(self.dtype)

    @property
    def resolved_inner_base_lr(self) -> float:
        if self.inner_base_lr is not None:
            return float(self.inner_base_lr)
        return 1.0 if self.layer_type == "linear" else 0.1

    def build_model(self) -> "TTTForCausalLM":
        """A randomly initialised :class:`TTTForCausalLM` in ``dtype``."""
        model = TTTForCausalLM(self)
        # skip a no-op .to(): under FakeTensorMode it would try (and fail) to swap parameters
        return model if self.torch_dtype == torch.float32 else model.to(self.torch_dtype)

    def build_tokenizer(self):
        from lit_memopt.models.hf import build_tokenizer

        return build_tokenizer(self.tokenizer)

    def hf_config(self):
        """The sizes as a transformers ``PretrainedConfig`` (for tools that read ``vocab_size``,
        ``hidden_size``, ``num_hidden_layers``... the way they do for :class:`ModelConfig`)."""
        from transformers import PretrainedConfig

        return PretrainedConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            tie_word_embeddings=self.tie_word_embeddings,
            ttt_layer_type=self.layer_type,
            mini_batch_size=self.mini_batch_size,
        )


class _CausalConv(nn.Module):
    """Depthwise causal 1-D convolution over the sequence (left padding only)."""

    def __init__(self, hidden_size: int, kernel: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel, groups=hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.pad(x.transpose(1, 2), (self.kernel - 1, 0))
        return self.conv(y).transpose(1, 2)


class _SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TTTBlock(nn.Module):
    """One pre-norm block: causal conv (optional), TTT layer, SwiGLU MLP, each on the residual stream."""

    def __init__(self, config: TTTConfig) -> None:
        super().__init__()
        C = config.hidden_size
        self.conv_norm = nn.RMSNorm(C, eps=config.rms_norm_eps) if config.conv_kernel else None
        self.conv = _CausalConv(C, config.conv_kernel) if config.conv_kernel else None
        self.seq_norm = nn.RMSNorm(C, eps=config.rms_norm_eps)
        kwargs: dict[str, Any] = dict(
            mini_batch_size=config.mini_batch_size,
            base_lr=config.resolved_inner_base_lr,
            checkpoint_group_size=config.checkpoint_group_size,
            initializer_range=config.initializer_range,
        )
        if config.layer_type == "mlp":
            kwargs["expansion"] = config.mlp_expansion
        self.ttt = ttt_layer_class(config.layer_type)(C, config.num_heads, **kwargs)
        self.ffn_norm = nn.RMSNorm(C, eps=config.rms_norm_eps)
        self.mlp = _SwiGLU(C, config.intermediate_size)
        self.checkpoint_conv = bool(config.checkpoint_conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv is not None and self.checkpoint_conv:
            group = self.ttt.resolve_group_size(x)
            if group > 0 and torch.is_grad_enabled():
                # the sequence-mixing half (conv + TTT) checkpointed as one: only x is kept
                x = self.ttt.recompute_in_backward(
                    lambda t: self._mixing(t, group), x, (self.conv_norm, self.conv, self.seq_norm, self.ttt)
                )
                return x + self.mlp(self.ffn_norm(x))
        if self.conv is not None:
            x = x + self.conv(self.conv_norm(x))
        x = x + self.ttt(x, self.seq_norm)
        return x + self.mlp(self.ffn_norm(x))

    def _mixing(self, x: torch.Tensor, group: int) -> torch.Tensor:
        x = x + self.conv(self.conv_norm(x))
        return x + self.ttt._layer_forward(x, group, self.seq_norm)


class TTTForCausalLM(nn.Module):
    """Embedding, :class:`TTTBlock` stack, final RMSNorm and an LM head weight.

    ``forward(input_ids)`` returns the final hidden states ``[B, T, C]``, never logits: feed them
    with :attr:`lm_head_weight` to :func:`lit_memopt.ops.linear_logprobs`.

    Args:
        config: the :class:`TTTConfig`.
    """

    def __init__(self, config: TTTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TTTBlock(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        std = config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and not isinstance(module, _TTTLayer):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        for block in self.layers:
            block.ttt.auto_num_layers = config.num_layers

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The ``[V, C]`` output-embedding weight."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def ttt_layers(self) -> list[_TTTLayer]:
        return [block.ttt for block in self.layers]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for block in self.layers:
            x = block(x)
        return self.norm(x)


# ----------------------------------------------------------------------------------------------
# Integration into a pretrained transformers causal LM
# ----------------------------------------------------------------------------------------------


@dataclass
class TTTIntegrationConfig:
    """Where and how to add gated TTT branches to a pretrained causal LM.

    Args:
        layers: decoder-layer indices that get a branch after their attention (negative indices
            count from the end); ``None`` means every layer.
        layer_type: ``linear`` or ``mlp``.
        num_heads: TTT heads; ``None`` uses the host's ``num_attention_heads``.
        mini_batch_size: tokens per inner step.
        inner_base_lr: ``eta_base``; ``None`` takes the paper's value for ``layer_type``.
        gate_init: initial ``alpha`` of the gate ``tanh(alpha)`` (per channel). 0 leaves the
            pretrained model's function exactly unchanged at the start.
        checkpoint_group_size: layer and scan checkpointing of each branch (0, a positive int, ``"auto"``).

    Raises:
        ValueError: on an unknown ``layer_type`` or bad sizes.
    """

    layers: Sequence[int] | None = None
    layer_type: str = "linear"
    num_heads: int | None = None
    mini_batch_size: int = 16
    inner_base_lr: float | None = None
    gate_init: float = 0.01
    checkpoint_group_size: int | str = 0

    def __post_init__(self) -> None:
        ttt_layer_class(self.layer_type)
        _check_group_size(self.checkpoint_group_size)
        if self.layers is not None:
            self.layers = [int(i) for i in self.layers]
        if self.mini_batch_size <= 0:
            raise ValueError(f"integration.mini_batch_size must be positive, got {self.mini_batch_size}.")


class GatedTTT(nn.Module):
    """A tanh-gated TTT branch: ``x + tanh(alpha) * TTT(RMSNorm(x))``.

    At ``alpha = 0`` it is the identity, so inserting it keeps a pretrained model's outputs.

    Args:
        layer: the TTT layer (:class:`TTTLinear` or :class:`TTTMLP`).
        gate_init: initial value of every channel of ``alpha``.
        eps: epsilon of the input RMSNorm.

    Example::

        branch = GatedTTT(TTTLinear(256, 4), gate_init=0.0)
        x = torch.randn(2, 32, 256)
        assert torch.equal(branch(x), x)
    """

    def __init__(self, layer: _TTTLayer, *, gate_init: float = 0.01, eps: float = 1e-6) -> None:
        super().__init__()
        self.ttt = layer
        self.norm = nn.RMSNorm(layer.hidden_size, eps=eps)
        self.gate = nn.Parameter(torch.full((layer.hidden_size,), float(gate_init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.gate).to(x.dtype) * self.ttt(x, self.norm)


class AttentionWithTTT(nn.Module):
    """Composition of a decoder layer's attention module and a :class:`GatedTTT` on its output.

    Replaces ``decoder_layer.self_attn`` (same call signature, same return structure): the
    attention runs unchanged, then its output goes through the gated TTT branch before the
    decoder layer adds it to the residual stream. Attributes not found here are looked up on the
    wrapped attention, so code reading e.g. ``self_attn.layer_idx`` keeps working.

    Args:
        attention: the original attention module.
        branch: the gated TTT branch.
    """

    def __init__(self, attention: nn.Module, branch: GatedTTT) -> None:
        super().__init__()
        self.attention = attention
        self.ttt_branch = branch

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.attention(*args, **kwargs)
        if isinstance(out, tuple):
            return (self.ttt_branch(out[0]), *out[1:])
        return self.ttt_branch(out)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["attention"], name)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    from lit_memopt.models.hf import decoder_of

    layers = getattr(decoder_of(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers (expected `decoder.layers`).")
    return layers


def add_ttt_layers(model: nn.Module, config: TTTIntegrationConfig | dict[str, Any] | None = None) -> list[GatedTTT]:
    """Insert gated TTT branches after the attention of chosen decoder layers of a transformers causal LM.

    The model is modified in place by composition: ``layer.self_attn`` becomes
    :class:`AttentionWithTTT` wrapping the original module (nothing in transformers is patched).
    The new modules take the dtype and device of the host's parameters.

    Args:
        model: a transformers ``*ForCausalLM`` (peft-wrapped or not).
        config: a :class:`TTTIntegrationConfig` or a dict of its fields.

    Returns:
        The inserted :class:`GatedTTT` branches (their parameters are the new ones to train).

    Raises:
        ValueError: if a layer index is out of range or a layer has no ``self_attn``.

    Example::

        model = ModelConfig(arch={...}).build_model()
        branches = add_ttt_layers(model, {"layers": [1, 3], "gate_init": 0.0})
    """
    if config is None:
        config = TTTIntegrationConfig()
    elif isinstance(config, dict):
        config = TTTIntegrationConfig(**config)
    layers = _decoder_layers(model)
    n = len(layers)
    indices = list(range(n)) if config.layers is None else list(config.layers)
    for i in indices:
        if not -n <= i < n:
            raise ValueError(f"integration.layers contains {i}, but the model has {n} decoder layers (0..{n - 1}).")
    indices = sorted({i % n for i in indices})
    host = getattr(model, "config", None)
    hidden_size = int(getattr(host, "hidden_size"))
    num_heads = config.num_heads or int(getattr(host, "num_attention_heads"))
    reference = next(model.parameters())
    cls = ttt_layer_class(config.layer_type)
    base_lr = config.inner_base_lr if config.inner_base_lr is not None else (1.0 if config.layer_type == "linear" else 0.1)
    branches = []
    for i in indices:
        layer = layers[i]
        attention = getattr(layer, "self_attn", None)
        if attention is None:
            raise ValueError(f"decoder layer {i} ({type(layer).__name__}) has no `self_attn` to follow.")
        if isinstance(attention, AttentionWithTTT):
            raise ValueError(f"decoder layer {i} already has a TTT branch.")
        ttt = cls(
            hidden_size,
            num_heads,
            mini_batch_size=config.mini_batch_size,
            base_lr=base_lr,
            checkpoint_group_size=config.checkpoint_group_size,
        )
        ttt.auto_num_layers = len(indices)
        branch = GatedTTT(ttt, gate_init=config.gate_init).to(device=reference.device, dtype=reference.dtype)
        layer.self_attn = AttentionWithTTT(attention, branch)
        branches.append(branch)
    return branches


def ttt_branches(model: nn.Module) -> list[GatedTTT]:
    """The :class:`GatedTTT` branches inside ``model`` (in module order)."""
    return [m for m in model.modules() if isinstance(m, GatedTTT)]

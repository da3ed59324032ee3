"""Policy-rollout pieces shared by the RL modules (Intuitor, CRSP): sampling, response log-probs
from hidden states, reference log-probs, group-normalised advantages.

Nothing here builds ``[B, T, V]`` logits outside ``generate`` (whose KV-cached decoding only ever
holds ``[B, V]`` for the last position): log-probs come from the decoder's hidden states through
``lit_memopt.ops.linear_logprobs``.

Layout convention: a rollout batch is ``[N, P + R]`` token ids, prompts left-padded to a common
length ``P`` and responses right-padded; the ``G`` samples of prompt ``i`` are rows
``i * G ... i * G + G - 1``. Per-token tensors (log-probs, masks) are aligned with ``input_ids``:
position ``t`` holds the quantity for token ``input_ids[:, t]`` predicted from the tokens before it.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from lit_memopt.models import decoder_hidden_states, lm_head_weight
from lit_memopt.models.tokens import left_pad
from lit_memopt.models.adapters import is_peft_model, reference_model as reference_network
from lit_memopt.memory.replay import Repeats, module_fingerprint, shared_region

__all__ = [
    "Rollout",
    "generate",
    "position_ids_from_mask",
    "response_hidden_states",
    "scatter_response",
    "sequence_token_logprobs",
    "reference_logprobs",
    "group_advantages",
    "share_rewards_of_identical_responses",
    "masked_mean",
    "is_peft_model",
]


@dataclass
class Rollout:
    """Sampled prompt + response ids.

    Attributes:
        input_ids: ``[N, P + R]`` prompt (left-padded) followed by response (right-padded) ids.
        attention_mask: ``[N, P + R]`` 1 on real prompt tokens and on response tokens up to and
            including the first EOS, 0 on padding and on anything generated after the first EOS.
        response_mask: ``[N, P + R]`` bool, True on response tokens up to and including the first
            EOS (the tokens whose log-probs enter a policy loss).
        prompt_length: ``P``, the padded prompt length (responses start at this column).
        num_samples: ``G``, samples per prompt; rows of one prompt are contiguous.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_length: int
    num_samples: int

    @property
    def response_ids(self) -> torch.Tensor:
        """``[N, R]`` the generated part (padding and post-EOS tokens included; use ``response_mask``)."""
        return self.input_ids[:, self.prompt_length :]

    @property
    def response_lengths(self) -> torch.Tensor:
        """``[N]`` number of response tokens per row (EOS included when generated)."""
        return self.response_mask.sum(dim=-1)

    def decode_responses(self, tokenizer: Any) -> list[str]:
        """Response texts (up to, not including, the first EOS), for reward checkers and logs."""
        texts = []
        mask = self.response_mask[:, self.prompt_length :]
        eos = getattr(tokenizer, "eos_token_id", None)
        for row, keep in zip(self.response_ids.tolist(), mask.tolist()):
            ids = [t for t, k in zip(row, keep) if k and t != eos]
            texts.append(tokenizer.decode(ids, skip_special_tokens=True))
        return texts


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as transformers' ``generate`` uses them.

    Re-scoring a left-padded rollout with default positions (``0..T-1``) would shift every
    prompt's RoPE phases and give log-probs of a different policy than the one that sampled.
    """
    positions = attention_mask.long().cumsum(dim=-1) - 1
    return positions.clamp_(min=0)


def _left_pad(sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    for row, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"prompt {row} is empty; every prompt needs at least one token.")
    return left_pad(sequences, pad_id, device=device)


def _model_device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters
        return torch.device("cpu")


def _special_id(name: str, given: int | None, tokenizer: Any, model: torch.nn.Module) -> int | None:
    if given is not None:
        return int(given)
    value = getattr(tokenizer, name, None) if tokenizer is not None else None
    if value is None:
        value = getattr(getattr(model, "config", None), name, None)
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return None if value is None else int(value)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    # Sampling must come from the policy without dropout, and gradient checkpointing (active only
    # in train mode) cannot coexist with the KV cache.
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _sharded_across_ranks(model: torch.nn.Module) -> bool:
    import torch.distributed as dist

    from lit_memopt.models.sharding import is_fsdp_sharded

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and is_fsdp_sharded(model)


def _sliding_window(model: torch.nn.Module) -> bool:
    """Whether any attention layer of ``model`` keeps a sliding window of the cache (its memory stops growing)."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    types = getattr(config, "layer_types", None) or ()
    return bool(getattr(config, "use_sliding_window", False)) or any("sliding" in str(t) for t in types)


def generate(
    model: torch.nn.Module,
    prompts: Sequence[str] | Sequence[Sequence[int]] | torch.Tensor,
    *,
    tokenizer: Any = None,
    attention_mask: torch.Tensor | None = None,
    num_samples: int = 1,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    greedy: bool = False,
) -> Rollout:
    """Sample ``num_samples`` responses per prompt with transformers' KV-cached ``generate``, no grad.

    Sampling is from the full softmax at ``temperature`` (``top_k`` disabled; ``top_p=1`` keeps the
    whole vocabulary) so that the log-probs recomputed by :func:`sequence_token_logprobs` at the same
    temperature are those of the sampling policy. The model runs in eval mode for the call and is
    restored afterwards.

    Args:
        model: a transformers causal LM (peft-wrapped or not).
        prompts: texts (needs ``tokenizer``; encoded without special tokens), lists of token ids,
            or a ``[B, P]`` id tensor (left-padded; pass its ``attention_mask``).
        tokenizer: encodes text prompts; also supplies EOS/pad ids when not given.
        attention_mask: ``[B, P]`` mask for a tensor of prompts (default: all ones).
        num_samples: ``G`` responses per prompt; rows ``i*G .. i*G+G-1`` belong to prompt ``i``.
        max_new_tokens: response length cap ``R``.
        temperature: sampling temperature, > 0.
        top_p: nucleus sampling mass in ``(0, 1]``; below 1 the sampler is no longer the policy
            that the recomputed log-probs describe (an off-policy approximation, as in most GRPO code).
        seed: makes sampling reproducible without touching the global RNG state.
        generator: alternative to ``seed``: a seed is drawn from it (advancing it).
        eos_token_id: stop token (default: tokenizer's, then the model config's).
        pad_token_id: padding id (default: tokenizer's, then the model config's, then EOS).
        greedy: the most likely token at each step instead of a sample (``temperature`` and ``top_p`` do not
            apply; ``num_samples`` must be 1): an evaluation of the policy's mode, not on-policy data.

    Returns:
        A :class:`Rollout`.

    Raises:
        ValueError: on a bad ``num_samples``, ``max_new_tokens``, ``temperature`` or ``top_p``, text
            prompts without a tokenizer, or ``greedy`` with ``num_samples > 1``.

    Example::

        rollout = generate(model, ["1+2=", "3+4="], tokenizer=tok, num_samples=4, max_new_tokens=16, seed=0)
        logp = sequence_token_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.response_mask)
    """
    if int(num_samples) < 1:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}.")
    if int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    if not float(temperature) > 0.0:
        raise ValueError(f"temperature must be > 0 (sampling from the policy), got {temperature!r}.")
    if not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}.")
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator to generate(), not both.")
    if greedy and int(num_samples) != 1:
        raise ValueError(f"greedy decoding gives one response per prompt: num_samples must be 1, got {num_samples!r}.")

    device = _model_device(model)
    eos_id = _special_id("eos_token_id", eos_token_id, tokenizer, model)
    pad_id = _special_id("pad_token_id", pad_token_id, tokenizer, model)
    if pad_id is None:
        pad_id = eos_id if eos_id is not None else 0

    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"a tensor of prompts must be [batch, prompt_length], got shape {tuple(prompts.shape)}.")
        prompt_ids = prompts.to(device=device, dtype=torch.long)
        prompt_mask = (
            torch.ones_like(prompt_ids) if attention_mask is None else attention_mask.to(device=device, dtype=torch.long)
        )
    else:
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty; give at least one prompt.")
        if isinstance(prompts[0], str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer: generate(model, prompts, tokenizer=tok, ...).")
            encoded = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        else:
            encoded = [list(map(int, p)) for p in prompts]
        prompt_ids, prompt_mask = _left_pad(encoded, pad_id, device)

    if generator is not None:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())

    prompt_length = prompt_ids.shape[1]
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": float(temperature),
                                                    "top_p": float(top_p), "top_k": 0}
    # A sharded model gathers its layers in every forward: all ranks must run the same number of
    # generation steps, so finished ranks keep stepping until every rank is done.
    synced = _sharded_across_ranks(model)
    with torch.no_grad(), _eval_mode(model), _seeded(seed, device):
        # Under a plan's traces (fake tensors) the rollout is the same for every setting searched: traced once,
        # replayed after that (memory.replay). Anywhere else this is just the call.
        def run(new_tokens: int) -> torch.Tensor:
            return model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **sampling,
                                  max_new_tokens=new_tokens, num_return_sequences=int(num_samples),
                                  eos_token_id=eos_id, pad_token_id=pad_id, use_cache=True, synced_gpus=synced)

        # A long rollout is stretched from three short ones (memory.stretch), where each token's step is the last's
        # with a longer cache: not with a sliding-window cache, which stops growing at its window.
        marker = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        repeats = (Repeats(int(max_new_tokens), run, marker)
                   if isinstance(marker, torch.nn.Module) and not _sliding_window(model) else None)
        sequences = shared_region(
            "rollout.generate",
            functools.partial(run, int(max_new_tokens)),
            inputs=(prompt_ids, prompt_mask),
            key=lambda: (tuple(sorted(sampling.items())), int(num_samples), eos_id, pad_id, synced,
                         module_fingerprint(model)),
            repeats=repeats,
        )
    if not isinstance(sequences, torch.Tensor):  # a GenerateOutput when the config asks for dicts
        sequences = sequences.sequences

    response = sequences[:, prompt_length:]
    if eos_id is not None:
        is_eos = response == eos_id
        # Tokens strictly after the first EOS: at least one EOS among the earlier positions.
        after_eos = (is_eos.long().cumsum(dim=-1) - is_eos.long()) > 0
        response_mask = ~after_eos
    else:
        response_mask = torch.ones_like(response, dtype=torch.bool)
    # num_return_sequences repeats each prompt G times in place (repeat_interleave order).
    prompt_mask = prompt_mask.repeat_interleave(int(num_samples), dim=0)
    full_response_mask = torch.cat([torch.zeros_like(prompt_mask, dtype=torch.bool), response_mask], dim=1)
    full_attention = torch.cat([prompt_mask, response_mask.long()], dim=1)
    return Rollout(
        input_ids=sequences,
        attention_mask=full_attention,
        response_mask=full_response_mask,
        prompt_length=prompt_length,
        num_samples=int(num_samples),
    )


def response_hidden_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decoder hidden states that predict the response tokens, gathered to ``[n_tokens, H]``.

    Only the rows the head needs are kept, so the head ops (log-probs, self-certainty, entropy) cost
    ``n_tokens`` rows, not ``B * T``. Gradients flow when called under grad.

    Returns:
        ``(hidden [n, H], targets [n], positions)`` where ``positions`` is the boolean ``[B, T]``
        mask (``response_mask`` without column 0) to put per-token results back in ``[B, T]`` with
        :func:`scatter_response`.
    """
    if input_ids.shape != attention_mask.shape or input_ids.shape != response_mask.shape:
        raise ValueError(
            "input_ids, attention_mask and response_mask must have the same [B, T] shape, got "
            f"{tuple(input_ids.shape)}, {tuple(attention_mask.shape)}, {tuple(response_mask.shape)}."
        )
    hidden = decoder_hidden_states(
        model,
        input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    )
    positions = response_mask.bool().clone()
    positions[:, 0] = False  # the first token has no prediction
    predictor = positions[:, 1:]  # hidden state t-1 predicts token t
    selected = hidden[:, :-1][predictor]
    targets = input_ids[positions]
    return selected, targets, positions


def scatter_response(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-token values ``[n]`` from the gathered rows of :func:`response_hidden_states` back to ``[B, T]``, zeros elsewhere."""
    # Boolean indexing and masked_scatter both walk the mask in row-major order, so this inverts
    # the gather in response_hidden_states; it is differentiable with respect to ``values``.
    return values.new_zeros(positions.shape).masked_scatter(positions, values)


def sequence_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Per-token log-probs ``[B, T]`` (fp32) of the response tokens under ``model``, zero elsewhere.

    Computed from the decoder hidden states with ``lit_memopt.ops.linear_logprobs`` (the
    ``[B, T, V]`` logits are never built); differentiable with respect to the model when grad is on.

    Args:
        model: the policy (peft-wrapped or not).
        input_ids, attention_mask, response_mask: ``[B, T]``, as in :class:`Rollout`.
        temperature: the sampling temperature (logits are divided by it).
        chunk_size: rows of the head computed at once (``None``: automatic).

    Example::

        logp = sequence_token_logprobs(policy, r.input_ids, r.attention_mask, r.response_mask, temperature=0.9)
    """
    from lit_memopt.ops import linear_logprobs

    hidden, targets, positions = response_hidden_states(model, input_ids, attention_mask, response_mask)
    logp = linear_logprobs(hidden, lm_head_weight(model), targets, temperature=temperature, chunk_size=chunk_size)
    return scatter_response(logp, positions)


def reference_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    reference_model: torch.nn.Module | None = None,
    temperature: float = 1.0,
    micro_batch_size: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Per-token log-probs ``[B, T]`` under the reference policy, without grad, chunked over the batch.

    The reference is ``reference_model`` when given; otherwise ``model`` must be a peft model and the
    reference is its base (``with model.disable_adapter():``), which shares the weights: no second
    copy of the network is held.

    Args:
        model: the policy.
        input_ids, attention_mask, response_mask: ``[B, T]``, as in :class:`Rollout`.
        reference_model: a separate frozen reference (costs one more copy of the weights).
        temperature: as for the policy log-probs.
        micro_batch_size: rows per forward pass (``None``: the whole batch at once); bounds the
            activation memory of the reference pass.
        chunk_size: head chunk, as in :func:`sequence_token_logprobs`.

    Raises:
        ValueError: when ``model`` is not a peft model and no ``reference_model`` is given, or on a bad
            ``micro_batch_size``.
    """
    if micro_batch_size is not None and int(micro_batch_size) < 1:
        raise ValueError(f"micro_batch_size must be a positive integer or None, got {micro_batch_size!r}.")
    if reference_model is None and not is_peft_model(model):
        raise ValueError(
            "reference_logprobs needs a reference: the policy is not a peft model (no adapter to disable), "
            "so pass reference_model=<frozen copy>, or enable LoRA (model.lora) to share the base weights."
        )
    step = input_ids.shape[0] if micro_batch_size is None else int(micro_batch_size)
    outputs = []
    with torch.no_grad(), reference_network(model, reference_model) as scorer, _eval_mode(scorer):
        for start in range(0, input_ids.shape[0], step):
            rows = slice(start, start + step)
            outputs.append(
                sequence_token_logprobs(
                    scorer,
                    input_ids[rows],
                    attention_mask[rows],
                    response_mask[rows],
                    temperature=temperature,
                    chunk_size=chunk_size,
                )
            )
    return torch.cat(outputs, dim=0)


def share_rewards_of_identical_responses(rewards: torch.Tensor, rollout: Rollout) -> torch.Tensor:
    """``rewards`` ``[N]`` with the responses of a group that are token-for-token identical given their mean.

    A reward is a function of the prompt and the response, but one computed in a batch (self-certainty from
    the policy's hidden states) gives identical responses values that differ by rounding, depending on their
    row and padding. Left alone, :func:`group_advantages` would rank identical responses against each other;
    a confident policy samples many such groups and would be trained on rounding noise.
    """
    group = int(rollout.num_samples)
    tokens = torch.where(rollout.response_mask, rollout.input_ids, -1)[:, rollout.prompt_length :]
    out = rewards.clone()
    for start in range(0, rewards.numel(), group):
        rows = tokens[start : start + group]
        _, labels = torch.unique(rows, dim=0, return_inverse=True)
        if int(labels.max()) + 1 == rows.shape[0]:
            continue  # all distinct
        sums = torch.zeros(rows.shape[0], dtype=rewards.dtype, device=rewards.device).index_add_(0, labels, rewards[start : start + group])
        counts = torch.bincount(labels, minlength=rows.shape[0]).to(rewards.dtype)
        out[start : start + group] = (sums / counts.clamp_min(1))[labels]
    return out


SCALE_REWARDS = ("group", "none")


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6, tie_tolerance: float = 1e-6,
                     scale: str = "group") -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std (+ ``eps``).

    ``scale="none"`` leaves out the division (Dr. GRPO; TRL's ``scale_rewards="none"``): a group whose
    rewards differ by little then moves the policy by little, instead of as much as a group whose
    responses differ in kind. A batch-wide std (TRL's ``"batch"``) is not offered: it would make a
    step's update depend on how a callback splits it into micro-batches.

    ``rewards`` is ``[N]`` with ``N = num_groups * group_size`` and the members of a group contiguous
    (the :func:`generate` layout). The std is the population std (``correction=0``), so a group of
    one, or a group whose rewards are all equal, gets advantages of exactly zero.

    A group whose rewards differ only by float rounding (std <= ``tie_tolerance * max(1, |mean|)``) counts
    as all equal: zero advantages. Dividing rounding noise by ``std + eps`` would make advantages of order
    one out of nothing. Rewards computed in a batch (self-certainty) give identical responses values that
    differ in their last bits: pass them through :func:`share_rewards_of_identical_responses` first.

    Raises:
        ValueError: on a bad ``group_size``, a reward count that is not a multiple of it, or an unknown ``scale``.

    Example::

        adv = group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), group_size=2)  # [1, -1, 0, 0]
    """
    if int(group_size) < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}.")
    if rewards.dim() != 1 or rewards.numel() % int(group_size) != 0:
        raise ValueError(
            f"rewards must be a 1-D tensor whose length is a multiple of group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}."
        )
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale!r} is not supported; use one of {list(SCALE_REWARDS)}.")
    grouped = rewards.float().view(-1, int(group_size))
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, correction=0)
    tied = std <= tie_tolerance * mean.abs().clamp_min(1.0)
    centred = grouped - mean
    return torch.where(tied, 0.0, centred / (std + eps) if scale == "group" else centred).view(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is true (over ``dim``, or all); 0 where empty."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1.0)

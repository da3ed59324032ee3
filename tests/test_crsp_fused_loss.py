"""CRSP's update step on the fused ``linear_policy_loss(objective="tr_rpg")`` against the two calls it replaced
(``linear_logprobs`` scattered to ``[B, T]``, then ``tr_rpg_loss`` over the response tokens), in float64: the same
role losses and the same gradient on every trainable parameter (a trainable tied head, one LoRA adapter, one LoRA
adapter per role); and the head products counted: three per vocabulary tile of a micro-batch instead of four with a
trained head, two as before with a frozen one."""

from __future__ import annotations

import functools

import pytest
import torch

from lit_memopt._compat.torch import TorchDispatchMode
from lit_memopt.callbacks.oom_recovery import OOMRecovery
from lit_memopt.models import ModelConfig, lm_head_weight
from lit_memopt.modules import crsp as crsp_module
from lit_memopt.modules.crsp import ROLES, CRSPModule, _Played
from lit_memopt.modules.rollout import generate, scatter_response

pytestmark = pytest.mark.timeout(300)

ARCH = dict(model_type="qwen3", vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
            tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
CHUNK = 100  # head tiles of 100 rows and 100 vocabulary entries: 4 vocabulary tiles (the last one 84 wide)
VOCAB_TILES = -(-ARCH["vocab_size"] // CHUNK)
VOCAB_TILE_WIDTHS = {CHUNK, ARCH["vocab_size"] % CHUNK}  # no product of the body has an operand this wide
PROMPTS = {"propose": ["def f(x):", "Input: 3"], "solve": ["f(2) =", "abc", "[1, 2]"], "critique": ["Verdict:"]}
REWARDS = {"propose": [0.7, -0.2, 0.1, 1.0], "solve": [1.0, 0.0, 0.5, -1.0, 2.0, 0.3], "critique": [0.4, -0.6]}


def _two_call_role_backward_active(self: CRSPModule, role: str, rollout, rewards: torch.Tensor) -> torch.Tensor:
    """``CRSPModule._role_backward_active`` as it was before the fused loss: per-token log-probs of the response
    rows scattered back to ``[B, T]``, then the masked mean of ``tr_rpg_loss`` (the reference's ``[B, T]``
    log-probs, one normalised reward per sequence)."""
    from lit_memopt.ops import linear_logprobs, tr_rpg_loss

    gen = self.generation
    ids, attn, resp = rollout.input_ids, rollout.attention_mask, rollout.response_mask
    counted = resp.clone()
    counted[:, 0] = False
    total = int(counted.sum())
    role_weight = self.roles.of(role).weight
    if total == 0 or role_weight == 0:
        return torch.zeros((), device=ids.device)
    mb = gen.micro_batch_size
    ref = crsp_module.reference_logprobs(self.model, ids, attn, resp, reference_model=self.reference,
                                         temperature=gen.temperature, micro_batch_size=mb, chunk_size=gen.chunk_size)
    advantages = self.normalizers[role].normalize(rewards.to(ids.device, torch.float32))
    weight = lm_head_weight(self.model)
    value = torch.zeros((), device=ids.device)
    beta, clamp = self.roles.of(role).beta, self.roles.clamp

    def micro_batch_loss(part: dict[str, torch.Tensor], share: float) -> torch.Tensor:
        hidden, targets, positions = crsp_module.response_hidden_states(self.model, part["input_ids"],
                                                                        part["attention_mask"], part["response_mask"])
        logp = scatter_response(linear_logprobs(hidden, weight, targets, temperature=gen.temperature,
                                                chunk_size=gen.chunk_size), positions)
        return tr_rpg_loss(logp, part["ref"], part["advantages"], beta, mask=positions, clamp=clamp) * share

    for start in range(0, ids.shape[0], mb):
        rows = slice(start, start + mb)
        share = role_weight * int(counted[rows].sum()) / total
        if share == 0:
            continue
        part = {"input_ids": ids[rows], "attention_mask": attn[rows], "response_mask": resp[rows],
                "ref": ref[rows], "advantages": advantages[rows]}
        loss = OOMRecovery.run_micro_batches(self, part, functools.partial(micro_batch_loss, share=share),
                                             sample_weights=counted[rows].sum(dim=-1))
        if loss is not None:
            value = value + loss
    return value


class _HeadProducts(TorchDispatchMode):
    """Counts the matrix products of the head while active and not ``paused`` (the reference pass, the same in both
    versions, is paused): those with an operand as wide as a vocabulary tile. A dispatch mode, as it sees the
    products of backward too (a ``TorchFunctionMode`` does not see those of an autograd Function's backward)."""

    PRODUCTS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_"})

    def __init__(self) -> None:
        super().__init__()
        self.count, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.overloadpacket.__name__ in self.PRODUCTS and any(
                isinstance(a, torch.Tensor) and not VOCAB_TILE_WIDTHS.isdisjoint(a.shape) for a in args):
            self.count += 1
        return func(*args, **(kwargs or {}))


class _NoStep:
    def step(self) -> None:  # the gradients are what is compared: keep them, and the weights, as they are
        pass


def _module(lora: str) -> CRSPModule:
    """A float64 CRSPModule whose policy differs from its reference (some log-ratios past the clamp), with
    micro-batches of 4 rows (the 6 solve rows split unevenly) and head tiles smaller than the vocabulary."""
    torch.manual_seed(0)
    config = ModelConfig(name="tiny", arch=dict(ARCH), lora=None if lora == "none" else {"r": 4, "alpha": 8})
    module = CRSPModule(config, config.build_tokenizer(), optim={"gradient_clip_val": None},
                        roles={"adapters": lora == "per-role", "clamp": 0.3, "solve": {"weight": 0.5}},
                        generation={"micro_batch_size": 4, "chunk_size": CHUNK, "temperature": 0.8})
    module.double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif lora == "none":  # the reference is a frozen copy: move the policy away from it
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        # A large EOS row of the (tied) head: responses end at varied lengths.
        module.model.get_input_embeddings().weight[ARCH["eos_token_id"]] = 2.0 * torch.randn(
            ARCH["hidden_size"], generator=g, dtype=torch.float64)
    return module


def _update(lora: str, monkeypatch, two_calls: bool) -> tuple[dict[str, float], dict[str, torch.Tensor], int, dict]:
    """One ``_update`` (the three role losses, each backpropagated in micro-batches) on fixed rollouts: the role
    losses, every trainable parameter's gradient, the head products of the policy passes, and the rollouts."""
    module = _module(lora)
    monkeypatch.setattr(module, "manual_backward", lambda loss: loss.backward())
    played = {}
    for i, role in enumerate(ROLES):
        with module._role(role):
            rollout = generate(module.model, PROMPTS[role], tokenizer=module.tokenizer, max_new_tokens=7,
                               num_samples=len(REWARDS[role]) // len(PROMPTS[role]), temperature=0.8, seed=i)
        played[role] = _Played(rollout, list(REWARDS[role]))
    counter = _HeadProducts()
    original_reference = crsp_module.reference_logprobs

    def paused_reference(*args, **kwargs):
        counter.paused = True
        try:
            return original_reference(*args, **kwargs)
        finally:
            counter.paused = False

    with monkeypatch.context() as patch:
        patch.setattr(crsp_module, "reference_logprobs", paused_reference)
        if two_calls:
            patch.setattr(CRSPModule, "_role_backward_active", _two_call_role_backward_active)
        with counter:
            losses = module._update(_NoStep(), played)
    grads = {n: p.grad.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    return {r: float(v) for r, v in losses.items()}, grads, counter.count, played


@pytest.mark.parametrize("lora", ["none", "one", "per-role"], ids=["trained-head", "lora", "lora-per-role"])
def test_the_update_step_equals_log_probs_then_tr_rpg_loss_in_float64(lora, monkeypatch) -> None:
    fused_losses, fused, fused_products, played = _update(lora, monkeypatch, two_calls=False)
    plain_losses, plain, plain_products, plain_played = _update(lora, monkeypatch, two_calls=True)
    for role in ROLES:  # the same rollouts
        assert torch.equal(played[role].rollout.input_ids, plain_played[role].rollout.input_ids)
        assert torch.equal(played[role].rollout.response_mask, plain_played[role].rollout.response_mask)
    lengths = torch.cat([p.rollout.response_mask.sum(-1) for p in played.values()])
    assert len(set(lengths.tolist())) > 2, lengths  # responses of several lengths: the [B, T] layouts differ
    assert fused.keys() == plain.keys() and fused
    assert all(fused[n].abs().sum() > 0 for n in fused if "lora_B" in n or lora == "none"), "a gradient is zero"
    if lora == "none":
        assert any(n.endswith("embed_tokens.weight") for n in fused)  # the tied head trains: its gradient is compared
    for role in ROLES:
        assert fused_losses[role] != 0.0
        assert fused_losses[role] == pytest.approx(plain_losses[role], rel=1e-12, abs=1e-14), role
    worst = max(float((fused[n] - plain[n]).abs().max()) for n in fused)
    print(f"\n[{lora}] max |fused - two calls| over every gradient: {worst:.3e}; head products {fused_products} "
          f"(fused) vs {plain_products} (two calls)")
    for name in fused:
        torch.testing.assert_close(fused[name], plain[name], rtol=1e-9, atol=1e-10, msg=name)
    # Head products per vocabulary tile of each micro-batch's policy pass. A trained head: the logits, the hidden
    # and the weight gradients in the forward (3), where the two calls recomputed the logits in backward (4). A
    # frozen head (LoRA): the logits and the hidden gradient (2), as the frozen per-token path already made them.
    passes = VOCAB_TILES * sum(-(-p.rollout.input_ids.shape[0] // 4) for p in played.values())
    per_tile = (3, 4) if lora == "none" else (2, 2)
    assert (fused_products, plain_products) == (per_tile[0] * passes, per_tile[1] * passes)

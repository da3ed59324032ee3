"""GRADE: soft-token properties, gradient routing, legacy == optimized at k = V, the embedded recipe learns."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from lit_memopt.data.prompts import PromptDataModule
from lit_memopt.models import ModelConfig, build_tokenizer
from lit_memopt.modules.grade import GradeModule
from lit_memopt.rewards.grade_reward import RuleRewardModel, build_rule_reward_model, sequence_reward

VOCAB = 384
ARCH = {
    "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "pad_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": True,
}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def reward_model(tokenizer) -> RuleRewardModel:
    return build_rule_reward_model(vocab_size=VOCAB, tokenizer=tokenizer, seq_len=6, train_steps=120)


def make_module(reward_model, *, lora: bool = False, **kw) -> GradeModule:
    torch.manual_seed(0)
    config = ModelConfig(name="tiny", arch=ARCH, lora=LORA if lora else None)
    kw.setdefault("max_new_tokens", 5)
    kw.setdefault("top_k", 16)
    return GradeModule(config, None, reward_model=copy.deepcopy(reward_model), **kw)


def prompts(batch: int = 3, length: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # one left-padded prompt
    ids[0, :2] = 0
    return ids, mask


def run(module: GradeModule, ids, mask, seed: int = 7, tau: float = 1.0):
    module.zero_grad(set_to_none=True)
    out = module.generate_and_score(ids, mask, tau=tau, generator=torch.Generator().manual_seed(seed))
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------- soft tokens
@pytest.mark.parametrize("hard", [True, False])
def test_soft_tokens_sum_to_one_and_stay_in_the_top_k(reward_model, hard: bool) -> None:
    module = make_module(reward_model, hard=hard)
    ids, mask = prompts()
    with torch.no_grad():
        out = module.generate_and_score(ids, mask, tau=0.7, generator=torch.Generator().manual_seed(3))
    assert out.weights.shape == out.ids.shape == (3, 5, 16)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(3, 5), rtol=0, atol=1e-6)
    if hard:
        # Straight-through: the forward value is exactly one-hot.
        assert bool(((out.weights == 0) | (out.weights == 1)).all())
        assert bool((out.weights == 1).sum(-1).eq(1).all())
    else:
        assert bool((out.weights > 0).all())
    picked = out.ids.gather(-1, out.weights.argmax(-1, keepdim=True)).squeeze(-1)
    assert torch.equal(picked, out.tokens)
    if hard:
        # Re-score prompt + hard tokens with a plain full forward: each step's candidates must be
        # exactly that step's top-k logits (and the cached soft decoding must match a full pass).
        full_ids = torch.cat([ids, out.tokens], dim=1)
        full_mask = torch.cat([mask, torch.ones_like(out.tokens)], dim=1)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = module.policy(input_ids=full_ids, attention_mask=full_mask, position_ids=positions).logits
        step_logits = logits[:, ids.shape[1] - 1 : -1]
        expected = step_logits.topk(16, dim=-1).indices.sort(-1).values
        assert torch.equal(out.ids.sort(-1).values, expected)


def test_soft_token_entropy_and_temperature_schedule(reward_model) -> None:
    module = make_module(reward_model, hard=False, tau_start=2.0, tau_end=0.5, tau_anneal_steps=10)
    assert module.current_tau(0) == 2.0 and module.current_tau(5) == pytest.approx(1.25) and module.current_tau(50) == 0.5
    ids, mask = prompts()
    with torch.no_grad():
        hot = module.generate_and_score(ids, mask, tau=5.0, generator=torch.Generator().manual_seed(3))
        cold = module.generate_and_score(ids, mask, tau=0.05, generator=torch.Generator().manual_seed(3))
    assert hot.soft_entropy.mean() > cold.soft_entropy.mean()
    assert bool((hot.soft_entropy <= torch.log(torch.tensor(16.0)) + 1e-5).all())


# ---------------------------------------------------------------------------- gradient routing
@pytest.mark.parametrize("lora", [False, True])
def test_gradients_reach_the_policy_only(reward_model, lora: bool) -> None:
    module = make_module(reward_model, lora=lora, checkpoint_steps=True)
    if lora:
        assert module.reference is None  # adapters disabled on the same weights, no copy
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)  # make pi != pi_ref so the KL has a gradient
    else:
        with torch.no_grad():
            for p in module.reference.parameters():
                p.add_(0.05 * torch.randn_like(p))
    ref_before = None if module.reference is None else copy.deepcopy(module.reference.state_dict())
    ids, mask = prompts()
    out, grads = run(module, ids, mask)
    assert out.kl.mean() > 0
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert set(grads) <= trainable
    if lora:
        assert trainable and all("lora_" in n for n in trainable)
    nonzero = [n for n, g in grads.items() if g.abs().sum() > 0]
    assert len(nonzero) >= 0.9 * len(trainable), (len(nonzero), len(trainable))
    assert all(p.grad is None for p in module.reward_model.parameters())
    if module.reference is not None:
        assert all(p.grad is None for p in module.reference.parameters())
        for name, value in module.reference.state_dict().items():
            assert torch.equal(value, ref_before[name])
    # The KL is optimised, not only logged: its own gradient reaches the policy.
    module.zero_grad(set_to_none=True)
    out = module.generate_and_score(ids, mask, tau=1.0, generator=torch.Generator().manual_seed(7))
    out.kl.mean().backward()
    assert sum(float(p.grad.abs().sum()) for p in module.policy.parameters() if p.grad is not None) > 0


def test_lora_reference_is_the_adapter_free_base(reward_model) -> None:
    module = make_module(reward_model, lora=True)
    ids, mask = prompts()
    with torch.no_grad():
        out0 = module.generate_and_score(ids, mask, tau=1.0, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(out0.kl, torch.zeros_like(out0.kl), atol=1e-5, rtol=0)  # lora_B = 0 at init
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
        out1 = module.generate_and_score(ids, mask, tau=1.0, generator=torch.Generator().manual_seed(5))
    assert out1.kl.mean() > 1e-4


# ---------------------------------------------------------------------------- legacy == optimized
@pytest.mark.parametrize("hard,checkpoint_steps", [(True, False), (False, True)])
def test_legacy_equals_optimized_at_full_vocabulary(reward_model, hard: bool, checkpoint_steps: bool) -> None:
    # float64 so that the sorted order of the vocabulary (which noise lands on which logit) cannot
    # differ between the cached and the re-run forward passes.
    optimized = make_module(reward_model, top_k=VOCAB, hard=hard, checkpoint_steps=checkpoint_steps, kl_coef=0.5).double()
    with torch.no_grad():
        for p in optimized.reference.parameters():
            p.add_(0.05 * torch.randn_like(p))  # a non-zero KL, so its gradient is compared too
    legacy = copy.deepcopy(optimized)
    legacy.hparams.memory_mode = "legacy"
    ids, mask = prompts()
    out_o, grads_o = run(optimized, ids, mask)
    out_l, grads_l = run(legacy, ids, mask)
    assert torch.equal(out_o.tokens, out_l.tokens)
    assert out_o.kl.mean() > 1e-3
    torch.testing.assert_close(out_o.reward, out_l.reward, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out_o.kl.double(), out_l.kl, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out_o.loss.double(), out_l.loss.double(), rtol=1e-5, atol=1e-6)
    assert grads_o.keys() == grads_l.keys() and len(grads_o) > 0
    for name in grads_o:
        scale = grads_l[name].abs().max().clamp_min(1e-8)
        assert float((grads_o[name] - grads_l[name]).abs().max() / scale) < 1e-4, name


# ---------------------------------------------------------------------------- rewards, errors
def test_rule_reward_model_scores_the_rule(tokenizer, reward_model) -> None:
    g = torch.Generator().manual_seed(11)
    ids = reward_model.sample_rule_batch(256, 6, g)
    scores = reward_model(input_ids=ids).logits.squeeze(-1)
    accuracy = ((scores > 0).float() == reward_model.rule_labels(ids)).float().mean()
    assert accuracy > 0.9
    vowels = torch.tensor([tokenizer("aeioua", add_special_tokens=False)["input_ids"]])
    consonants = torch.tensor([tokenizer("bcdfgh", add_special_tokens=False)["input_ids"]])
    assert reward_model(input_ids=vowels).logits.item() > 0 > reward_model(input_ids=consonants).logits.item()
    two_labels = torch.tensor([[0.0, 2.0], [1.0, 1.0]])
    torch.testing.assert_close(sequence_reward(two_labels, 1), torch.tensor([0.8807971, 0.5]))
    with pytest.raises(ValueError, match="reward_label"):
        sequence_reward(two_labels, None)


def test_bad_arguments_are_named(reward_model) -> None:
    with pytest.raises(ValueError, match="memory_mode"):
        make_module(reward_model, memory_mode="fast")
    with pytest.raises(ValueError, match="top_k"):
        make_module(reward_model, top_k=VOCAB + 1)
    with pytest.raises(ValueError, match="tau_end"):
        make_module(reward_model, tau_end=0.0)
    small = RuleRewardModel(100, [5, 6])
    with pytest.raises(ValueError, match="vocabulary"):
        GradeModule(ModelConfig(name="tiny", arch=ARCH), None, reward_model=small)
    with pytest.raises(TypeError, match="reward_model"):
        GradeModule(ModelConfig(name="tiny", arch=ARCH), None, reward_model="sentiment")


def test_prompt_datamodule_left_pads_and_is_deterministic(tokenizer) -> None:
    dm = PromptDataModule(tokenizer, num_prompts=20, num_val_prompts=4, prompt_length=12, min_prompt_length=5, batch_size=4)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (4, 12)
    mask = dm.train_set.attention_mask
    assert bool((mask.sum(-1) >= 5).all()) and bool(mask[:, -1].eq(1).all())
    assert bool((mask.diff(dim=-1) >= 0).all())  # zeros only on the left
    assert bool(dm.train_set.input_ids[mask == 0].eq(tokenizer.pad_token_id).all())
    again = PromptDataModule(tokenizer, num_prompts=20, num_val_prompts=4, prompt_length=12, min_prompt_length=5, batch_size=4)
    again.setup("fit")
    assert torch.equal(dm.train_set.input_ids, again.train_set.input_ids)
    text = tokenizer.decode(dm.train_set.input_ids[0][mask[0] == 1])
    assert text.strip() and text.replace(" ", "").isalpha()
    assert len(dm.val_dataloader()) == 1
    with pytest.raises(ValueError, match="min_prompt_length"):
        PromptDataModule(tokenizer, prompt_length=4, min_prompt_length=5)


# ---------------------------------------------------------------------------- the embedded recipe
def test_embedded_recipe_reward_rises(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lit_memopt import cli

    # The recipe as shipped, with shorter generations so that the test stays fast.
    cfg = cli.compose_config(
        [
            "recipe=grade", "data.num_prompts=64", "data.batch_size=8", "module.max_new_tokens=8",
            f"logger.save_dir={tmp_path}",
        ]
    )
    pl.seed_everything(0)
    objects = cli.instantiate_run(cfg)
    module = objects.module
    assert isinstance(module, GradeModule) and module.summary_keys[:5] == ("train/reward", "train/kl", "val/reward", "val/reward_stderr", "val/kl")
    ids, mask = prompts(batch=8, length=12)

    def held_out_reward() -> float:
        with torch.no_grad():
            out = module.generate_and_score(ids, mask, tau=0.5, generator=torch.Generator().manual_seed(123))
        return float(out.reward.mean())

    start = held_out_reward()
    # The recipe's default callbacks (MemoryMonitor, OOMRecovery) run unchanged around the module.
    assert objects.callbacks
    trainer = pl.Trainer(
        max_steps=10, accelerator="cpu", logger=pl.loggers.CSVLogger(tmp_path), enable_checkpointing=False,
        callbacks=objects.callbacks, default_root_dir=tmp_path,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, log_every_n_steps=1,
        gradient_clip_val=1.0,
    )
    trainer.fit(module, datamodule=objects.datamodule)
    end = held_out_reward()
    assert end > start + 1.0, (start, end)
    logged = trainer.logged_metrics
    assert float(logged["train/kl"]) < 1.0, float(logged["train/kl"])  # the recipe's kl_coef keeps the policy close
    for key in ("train/reward", "train/kl", "train/tau", "train/soft_token_entropy", "train/policy_entropy", "train/tokens_per_s"):
        assert key in logged, key
    assert float(logged["train/tau"]) < 2.0


def test_a_local_reward_checkpoint_scores_the_users_policy(user_checkpoint, tmp_path) -> None:
    """module.reward_model.pretrained=DIR: a user's sequence classifier (saved with save_pretrained) is the reward."""
    import functools

    from transformers import AutoConfig, AutoModelForSequenceClassification

    from lit_memopt.rewards.grade_reward import build_sequence_classifier

    config = AutoConfig.from_pretrained(user_checkpoint, num_labels=2)
    torch.manual_seed(3)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "reward")
    saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "reward")
    policy = ModelConfig(name="user", pretrained=str(user_checkpoint))
    module = GradeModule(policy, policy.build_tokenizer(), max_new_tokens=3, top_k=8, reward_label=1,
                         reward_model=functools.partial(build_sequence_classifier, pretrained=str(tmp_path / "reward"),
                                                        num_labels=2))
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(module.reward_model.state_dict()[name], value, rtol=0, atol=0, msg=name)
    assert not any(p.requires_grad for p in module.reward_model.parameters())
    ids = torch.tensor([[5, 6, 7, 8]])
    out, grads = run(module, ids, torch.ones_like(ids))
    assert 0.0 <= float(out.reward[0]) <= 1.0 and grads  # the probability of label 1, and the policy learns from it

"""IntuitorModule: the self-certainty score vs plain logits, an end-to-end training step (frozen-copy and
LoRA references), argument errors, the prompt data and its checker."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from lit_memopt.data.reasoning_prompts import ReasoningPromptsDataModule, answer_is_correct, extract_answer, make_problem
from lit_memopt.models import ModelConfig
from lit_memopt.modules import IntuitorModule
from lit_memopt.modules.rollout import position_ids_from_mask
from lit_memopt.ops import linear_self_certainty


def _config(lora: dict | None = None) -> ModelConfig:
    return ModelConfig(
        name="micro",
        arch={
            "model_type": "qwen3",
            "vocab_size": 384,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 128,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
            "eos_token_id": 1,
        },
        lora=lora,
    )


def test_self_certainty_op_is_kl_from_uniform_plus_log_vocab():
    torch.manual_seed(0)
    hidden, weight, temperature = torch.randn(3, 5, 16), torch.randn(50, 16), 0.6
    probs = torch.softmax(hidden @ weight.T / temperature, dim=-1)
    vocab = weight.shape[0]
    uniform = torch.full_like(probs, 1.0 / vocab)
    kl_uniform_p = (uniform * (uniform.log() - probs.log())).sum(-1)  # KL(U || p) written out
    score = linear_self_certainty(hidden, weight, temperature=temperature, chunk_size=7)
    torch.testing.assert_close(score, kl_uniform_p + math.log(vocab), atol=1e-4, rtol=1e-5)
    assert (score >= math.log(vocab) - 1e-5).all()


def _batch(tokenizer, prompts: list[str], answers: list[str]) -> dict:
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    length = max(map(len, ids))
    input_ids = torch.zeros(len(ids), length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(ids):
        input_ids[row, length - len(seq) :] = torch.tensor(seq)
        attention_mask[row, length - len(seq) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "prompts": prompts, "answers": answers}


class _Logged:
    """Captures ``self.log`` calls of a module used outside a Trainer."""

    def __init__(self, module: pl.LightningModule) -> None:
        self.values: dict[str, float] = {}
        module.log = lambda name, value, **kw: self.values.__setitem__(name, float(value))  # type: ignore[method-assign]


@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8}], ids=["frozen-copy", "lora"])
def test_training_step_end_to_end(lora):
    torch.manual_seed(0)
    config = _config(lora)
    tokenizer = config.build_tokenizer()
    module = IntuitorModule(config, tokenizer, num_samples=3, max_new_tokens=5, temperature=0.8, checker=answer_is_correct)
    logged = _Logged(module)
    assert (module.reference is None) == (lora is not None)  # LoRA shares the base weights
    before = {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    optimizer = module.configure_optimizers()["optimizer"]
    batch = _batch(tokenizer, ["1+2=", "copy ab="], ["3", "ab"])
    loss = module.training_step(batch, 0)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in module.model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0
    optimizer.step()
    assert any(not torch.equal(before[n], p) for n, p in module.model.named_parameters() if p.requires_grad)
    if module.reference is not None:
        assert not any(p.requires_grad for p in module.reference.parameters())
    for key in ("train/self_certainty", "train/kl", "train/response_length", "train/truncated", "train/accuracy", "train/reward",
                "train/loss"):
        assert key in logged.values and math.isfinite(logged.values[key])
    assert logged.values["train/self_certainty"] >= -1e-5  # KL(U || p) >= 0
    assert 1 <= logged.values["train/response_length"] <= 5


@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8}], ids=["frozen-copy", "lora"])
def test_the_fused_policy_loss_gives_the_gradients_of_log_probs_then_ppo_clip_loss(lora, monkeypatch):
    """The step's fused ``linear_policy_loss`` against the plain formula it replaced, in float64: the same rollout,
    the same loss and the same gradients (the reference's k3 KL term included)."""
    import lit_memopt.ops as ops
    from lit_memopt.ops import linear_logprobs, ppo_clip_loss

    def plain(hidden, weight, targets, logp_old, advantages, *, clip_eps, ref_logp, kl_coef, temperature, chunk_size):
        logp = linear_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size)
        return ppo_clip_loss(logp, logp.detach(), advantages, clip_eps=clip_eps, ref_logp=ref_logp, kl_coef=kl_coef)

    def step(replace: bool) -> tuple[float, list[torch.Tensor]]:
        torch.manual_seed(0)
        config = _config(lora)
        module = IntuitorModule(config, config.build_tokenizer(), num_samples=3, max_new_tokens=5, temperature=0.8,
                                kl_coef=0.05, checker=answer_is_correct)
        module.double()
        _Logged(module)
        with monkeypatch.context() as patch:
            if replace:
                patch.setattr(ops, "linear_policy_loss", plain)
            loss = module.training_step(_batch(module.tokenizer, ["1+2=", "copy ab="], ["3", "ab"]), 0)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in module.model.parameters() if p.requires_grad]

    fused_loss, fused = step(False)
    plain_loss, reference = step(True)
    assert sum(g.abs().sum() for g in fused) > 0  # a step that moves the policy, or the equality says nothing
    assert fused_loss == pytest.approx(plain_loss, rel=1e-12, abs=1e-14)
    for a, b in zip(fused, reference):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_truncated_responses_are_those_cut_at_the_cap_without_eos():
    config = _config()
    tokenizer = config.build_tokenizer()
    module = IntuitorModule(config, tokenizer, num_samples=2, max_new_tokens=3)
    eos = tokenizer.eos_token_id
    from lit_memopt.modules.rollout import Rollout

    # responses: cut at the cap; EOS as the last allowed token; EOS early; none finished and cut
    response = torch.tensor([[5, 6, 7], [5, 6, eos], [5, eos, 0], [8, 8, 8]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    prompt = torch.full((4, 2), 9)
    rollout = Rollout(torch.cat([prompt, response], 1), torch.cat([torch.ones(4, 2, dtype=torch.long), mask.long()], 1),
                      torch.cat([torch.zeros(4, 2, dtype=torch.bool), mask], 1), prompt_length=2, num_samples=2)
    assert module._truncated(rollout).tolist() == [True, False, False, True]


def test_self_certainty_reward_matches_plain_logits():
    """The reward the module computes equals the masked mean of KL(U || p) from full logits."""
    torch.manual_seed(0)
    config = _config()
    tokenizer = config.build_tokenizer()
    module = IntuitorModule(config, tokenizer, num_samples=2, max_new_tokens=4, temperature=0.7, kl_coef=0.0)
    captured = {}
    import lit_memopt.modules.intuitor as intuitor

    original = intuitor.group_advantages

    def spy(rewards, group_size, eps, **kwargs):
        captured["rewards"] = rewards.clone()
        return original(rewards, group_size, eps, **kwargs)

    intuitor.group_advantages = spy
    try:
        _Logged(module)
        seed = module._rollout_seed(0)
        module.training_step(_batch(tokenizer, ["5+5=", "max(1,2)="], ["10", "2"]), 0)
    finally:
        intuitor.group_advantages = original
    rollout = module._rollout(_batch(tokenizer, ["5+5=", "max(1,2)="], ["10", "2"]), 2, seed)  # same seed: same samples
    with torch.no_grad():
        logits = module.model(rollout.input_ids, attention_mask=rollout.attention_mask,
                              position_ids=position_ids_from_mask(rollout.attention_mask)).logits[:, :-1] / 0.7
    logp = torch.log_softmax(logits, dim=-1)
    kl_uniform = -math.log(logp.shape[-1]) - logp.mean(dim=-1)
    mask = rollout.response_mask[:, 1:].float()
    expected = (kl_uniform * mask).sum(-1) / mask.sum(-1)
    torch.testing.assert_close(captured["rewards"], expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_scale_rewards_reaches_the_advantages(monkeypatch, scale_rewards):
    """``module.scale_rewards`` decides the advantages of the step: centred rewards, divided by the group's std
    only under ``"group"``."""
    import lit_memopt.modules.intuitor as intuitor

    torch.manual_seed(0)
    config = _config()
    tokenizer = config.build_tokenizer()
    module = IntuitorModule(config, tokenizer, num_samples=4, max_new_tokens=4, kl_coef=0.0, scale_rewards=scale_rewards)
    seen = {}
    original = intuitor.group_advantages

    def spy(rewards, group_size, eps, **kwargs):
        seen["rewards"], seen["scale"] = rewards.clone(), kwargs.get("scale")
        seen["advantages"] = original(rewards, group_size, eps, **kwargs)
        return seen["advantages"]

    monkeypatch.setattr(intuitor, "group_advantages", spy)
    _Logged(module)
    module.training_step(_batch(tokenizer, ["5+5=", "max(1,2)="], ["10", "2"]), 0)
    assert seen["scale"] == scale_rewards
    grouped = seen["rewards"].view(2, 4)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    expected = centred / (grouped.std(dim=1, keepdim=True, correction=0) + 1e-6) if scale_rewards == "group" else centred
    # distinct samples of a random model differ by ~1e-4 in self-certainty: the two scalings are far apart
    assert centred.abs().max() > 1e-5 and (centred / (grouped.std(dim=1, keepdim=True, correction=0) + 1e-6)).abs().max() > 0.5
    torch.testing.assert_close(seen["advantages"].view(2, 4), expected, rtol=1e-4, atol=1e-8)


def test_steps_on_a_verifiable_reward_raise_its_rate():
    """The whole RL step points the right way: sampling, the checker's reward, group advantages, the
    clipped loss and its gradient. With ``accuracy_weight=1`` and a checker a random model passes about a
    third of the time, 20 SGD steps on one batch make nearly every fresh sample pass. A sign error takes
    the rate to ~0 and advantages paired with the wrong group's responses leave it where it was (both
    tried by patching ``group_advantages``)."""
    torch.manual_seed(0)
    config = _config()
    tokenizer = config.build_tokenizer()

    def even_first_character(text: str, answer: str) -> float:  # any property of the response will do
        return float(len(text) > 0 and text[0].isascii() and ord(text[0]) % 2 == 0)

    module = IntuitorModule(config, tokenizer, num_samples=8, max_new_tokens=3, checker=even_first_character,
                            accuracy_weight=1.0, kl_coef=0.0)
    _Logged(module)
    batch = _batch(tokenizer, ["1+2=", "copy ab="], ["3", "ab"])
    optimizer = torch.optim.SGD(module.model.parameters(), lr=0.5)

    def pass_rate(seed: int) -> float:
        with torch.no_grad():
            return float(module._accuracy(batch, module._rollout(batch, 64, seed)).mean())

    start = pass_rate(100)
    for step in range(20):
        loss = module.training_step(batch, step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    end = pass_rate(101)
    assert start < 0.6 and end > 0.9, (start, end)


def test_argument_errors():
    config = _config()
    with pytest.raises(ValueError, match="num_samples"):
        IntuitorModule(config, num_samples=1)
    with pytest.raises(ValueError, match="accuracy_weight"):
        IntuitorModule(config, accuracy_weight=1.5)
    with pytest.raises(ValueError, match="temperature"):
        IntuitorModule(config, temperature=0.0)
    with pytest.raises(ValueError, match="module.scale_rewards must be one of"):
        IntuitorModule(config, scale_rewards="batch")
    module = IntuitorModule(config, accuracy_weight=0.5)
    with pytest.raises(ValueError, match="checker"):
        module.setup("fit")


def test_reasoning_prompts_and_checker():
    import random

    rng = random.Random(0)
    for task in ("add", "sub", "mul", "max", "copy", "reverse"):
        question, answer = make_problem(rng, task)
        if task == "add":
            a, b = map(int, question.split("+"))
            assert int(answer) == a + b
        if task == "reverse":
            assert answer == question.split()[1][::-1]
    assert extract_answer("19;abc") == "19"
    assert extract_answer("I think... Answer: 42.") == "42"
    assert extract_answer("cba rest") == "cba"
    assert extract_answer("?!") is None
    assert answer_is_correct("Answer: 7", "7") == 1.0 and answer_is_correct("8", "7") == 0.0
    tokenizer = _config().build_tokenizer()
    dm = ReasoningPromptsDataModule(tokenizer, task="arithmetic", num_train=8, num_val=4, batch_size=4)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 4 and len(batch["answers"]) == 4
    assert (batch["attention_mask"][:, -1] == 1).all()  # left padding: every prompt ends at the last column
    text = tokenizer.decode(batch["input_ids"][0][batch["attention_mask"][0].bool()])
    assert text in batch["prompts"] and text.endswith("=")
    with pytest.raises(ValueError, match="data.task"):
        ReasoningPromptsDataModule(tokenizer, task="poetry")
    fixed = ReasoningPromptsDataModule(tokenizer, task="strings", num_train=64, num_val=16, min_word_length=4,
                                       max_word_length=4)
    fixed.setup()
    assert {len(a) for a in fixed.train_set.answers + fixed.val_set.answers} == {4}
    assert {len(a) for _, a in fixed.warm_start_examples(32, seed=1)} == {4}
    with pytest.raises(ValueError, match="min_word_length"):
        ReasoningPromptsDataModule(tokenizer, task="strings", min_word_length=6, max_word_length=5)


def test_works_under_oom_recovery_micro_batches(tmp_path):
    """Automatic optimization: OOMRecovery splits the prompt batch; each micro-batch forms its own groups."""
    from lit_memopt.callbacks import OOMRecovery

    config = _config()
    tokenizer = config.build_tokenizer()
    dm = ReasoningPromptsDataModule(tokenizer, task="arithmetic", num_train=4, num_val=2, batch_size=4)
    module = IntuitorModule(config, tokenizer, num_samples=2, max_new_tokens=4)
    calls = []
    original = module.training_step

    def counting_step(batch, batch_idx):
        calls.append(batch["input_ids"].shape[0])
        return original(batch, batch_idx)

    module.training_step = counting_step  # type: ignore[method-assign]
    recovery = OOMRecovery(initial_micro_batch_size=2, grow_after_steps=None)
    trainer = pl.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[recovery],
    )
    before = [p.detach().clone() for p in module.model.parameters()]
    trainer.fit(module, datamodule=dm)
    assert calls == [2, 2]  # two micro-batches of two prompts, each with its own groups of rollouts
    assert any(not torch.equal(b, p) for b, p in zip(before, module.model.parameters()))
    assert "train/self_certainty" in trainer.callback_metrics

"""CRSPModule: role loss vs a naive full-logits path (forward and backward), parsing, and end-to-end steps."""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import pytest
import torch

from lit_memopt.data.code_tasks import CodeTaskDataModule
from lit_memopt.models import ModelConfig
from lit_memopt.modules.crsp import CRSPModule, _split_list_repr, parse_answer, parse_judgement, parse_proposal
from lit_memopt.modules.rollout import generate, position_ids_from_mask
from lit_memopt.ops import tr_rpg_loss
from lit_memopt.rewards.crsp_rewards import RunningNormalizer

pytestmark = pytest.mark.timeout(300)

ARCH = dict(model_type="qwen3", vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
            tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
FAST = dict(generation={"max_new_tokens": {"propose": 16, "solve": 8, "critique": 8}, "micro_batch_size": 4},
            roles={"num_solver_samples": 2, "critiques_per_task": 1}, sandbox={"workers": 2, "wall_time_s": 5.0})


def _config(lora: bool = True) -> ModelConfig:
    return ModelConfig(name="tiny", arch=dict(ARCH), lora={"r": 4, "alpha": 8} if lora else None)


def _merged(base: dict, overrides: dict) -> dict:
    """``base`` with ``overrides`` merged in, nested groups key by key."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _module(**overrides) -> CRSPModule:
    """A fast CRSPModule; ``overrides`` are module groups (``roles={"adapters": True}``), merged into FAST's."""
    config = _config()
    return CRSPModule(config, config.build_tokenizer(), **_merged(FAST, overrides))


def _trainer(steps: int = 1) -> pl.Trainer:
    return pl.Trainer(max_steps=steps, gradient_clip_val=None, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, accelerator="cpu")


# ------------------------------------------------------------------------------- parsing
def test_parsers_extract_without_executing() -> None:
    text = "<think>hmm</think>```python\ndef f(x):\n    return x + 1\n```\nInput: 3\nInput: [1, 2]\n"
    program, inputs = parse_proposal(text)
    assert program == "def f(x):\n    return x + 1\n" and inputs == ["3", "[1, 2]"]
    assert parse_proposal("def f(x):\n    return x\nInput: 'a'") == ("def f(x):\n    return x\n", ["'a'"])
    assert parse_proposal("no function here\nInput: 3") is None
    assert parse_proposal("def f(x): return x") is None  # no input
    assert parse_answer("<think>2+2</think><answer> 4 </answer>") == "4"
    assert parse_answer("<think>x</think>\n  [1, 2]\nmore") == "[1, 2]"
    assert parse_judgement("it looks fine. Verdict: correct") is True
    assert parse_judgement("Verdict: correct... no wait. Verdict: Incorrect") is False
    assert parse_judgement("this is incorrect") is False and parse_judgement("nothing") is None
    assert _split_list_repr("[1, 'a, b', [2, 3], {'k': (4, 5)}]", 4) == ["1", "'a, b'", "[2, 3]", "{'k': (4, 5)}"]
    assert _split_list_repr("['it\\'s, ok', 2]", 2) == ["'it\\'s, ok'", "2"]
    assert _split_list_repr("[1, 2]", 3) is None


def test_bad_arguments_are_named() -> None:
    config = _config()
    tokenizer = config.build_tokenizer()
    with pytest.raises(ValueError, match=r"module.roles.critiques_per_task must be an integer in \[1, num_solver_samples=2\]"):
        CRSPModule(config, tokenizer, roles={"num_solver_samples": 2, "critiques_per_task": 3})
    with pytest.raises(ValueError, match="module.roles.solve.beta must be >= 0, got -1.0"):
        CRSPModule(config, tokenizer, roles={"solve": {"beta": -1.0}})
    with pytest.raises(ValueError, match="module.roles.propose.weight must be >= 0, got -0.5"):
        CRSPModule(config, tokenizer, roles={"propose": {"weight": -0.5}})
    with pytest.raises(ValueError, match="module.roles.adapters=true needs LoRA"):
        CRSPModule(_config(lora=False), tokenizer, roles={"adapters": True})


# ----------------------------------------------------------------- loss vs naive logits path
def _naive_role_loss(model, rollout, rewards, beta, clamp, temperature=1.0) -> torch.Tensor:
    ids, attn, resp = rollout.input_ids, rollout.attention_mask, rollout.response_mask
    kwargs = dict(attention_mask=attn, position_ids=position_ids_from_mask(attn), use_cache=False)

    def token_logp(logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)

    with torch.no_grad(), model.disable_adapter():
        ref = token_logp(model(input_ids=ids, **kwargs).logits)
    logp = token_logp(model(input_ids=ids, **kwargs).logits)
    counted = resp.clone()
    counted[:, 0] = False
    advantages = RunningNormalizer().normalize(rewards)
    return tr_rpg_loss(logp, ref, advantages, beta, mask=counted, clamp=clamp)


def test_role_loss_matches_naive_forward_and_backward(monkeypatch) -> None:
    module = _module()
    model = module.model
    torch.manual_seed(1)
    with torch.no_grad():  # move the adapters away from zero so policy and reference differ
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    rollout = generate(model, ["abc", "hello world", "x"], tokenizer=module.tokenizer, num_samples=2,
                       max_new_tokens=6, seed=0)
    rewards = torch.tensor([1.0, 0.0, 0.5, -1.0, 2.0, 0.3])
    lora = [p for n, p in model.named_parameters() if p.requires_grad]

    naive = _naive_role_loss(model, rollout, rewards, module.roles.solve.beta, module.roles.clamp)
    naive.backward()
    naive_grads = [p.grad.clone() for p in lora]
    assert any(g.abs().sum() > 0 for g in naive_grads)

    monkeypatch.setattr(module, "manual_backward", lambda loss: loss.backward())
    for micro_batch_size in (1, 4, 8):  # one row per pass, uneven split, whole batch
        model.zero_grad(set_to_none=True)
        module.normalizers["solve"] = RunningNormalizer()
        module.generation = dataclasses.replace(module.generation, micro_batch_size=micro_batch_size)
        fused = module._role_backward("solve", rollout, rewards)
        assert torch.allclose(fused, naive.detach(), atol=1e-5, rtol=1e-4)
        for got, want in zip((p.grad for p in lora), naive_grads):
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-3)

    # roles.solve.weight scales the role's loss and gradient, nothing else
    halved = _module(roles={"solve": {"weight": 0.5}})
    halved.load_state_dict(module.state_dict())
    monkeypatch.setattr(halved, "manual_backward", lambda loss: loss.backward())
    fused = halved._role_backward("solve", rollout, rewards)
    assert torch.allclose(fused, 0.5 * naive.detach(), atol=1e-5, rtol=1e-4)
    for got, want in zip((p.grad for p in halved.model.parameters() if p.requires_grad), naive_grads):
        assert torch.allclose(got, 0.5 * want, atol=1e-5, rtol=1e-3)


# ------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_training_step_runs_all_three_roles(monkeypatch) -> None:
    module = _module()
    before = {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    contributed = {}
    role_backward = module._role_backward

    def recording(role, rollout, rewards):
        # Gradients accumulate over the roles: each role must add its own.
        grads = lambda: [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in before_params]
        start = grads()
        value = role_backward(role, rollout, rewards)
        contributed[role] = sum(float((g1 - g0).abs().sum()) for g0, g1 in zip(start, grads()))
        return value

    before_params = [p for p in module.model.parameters() if p.requires_grad]
    monkeypatch.setattr(module, "_role_backward", recording)
    trainer = _trainer(1)
    trainer.fit(module, datamodule=CodeTaskDataModule(module.tokenizer, batch_size=2))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    for role in ("propose", "solve", "critique"):
        assert f"train/loss_{role}" in metrics and f"train/reward_{role}" in metrics
        assert torch.isfinite(torch.tensor(metrics[f"train/loss_{role}"]))
    assert set(contributed) == {"propose", "solve", "critique"}
    assert contributed["solve"] > 0 and contributed["critique"] > 0
    assert sum(metrics[f"train/sandbox_{v}"] for v in ("ok", "wrong", "error", "timeout", "memory")) > 0
    assert 0.0 <= metrics["train/sandbox_cache_hit_rate"] <= 1.0
    assert metrics["train/alpha_s"] == pytest.approx(0.3) and metrics["train/alpha_c"] == pytest.approx(0.1)
    changed = [n for n, p in module.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed, "the optimizer step changed no parameter"
    assert trainer.global_step == 1
    assert module.normalizers["solve"].count.item() == 4  # 2 tasks x 2 solver samples


@pytest.mark.slow
def test_scripted_policy_gets_execution_decided_rewards(monkeypatch) -> None:
    """Replace the sampled texts with scripted ones and check every reward that execution decides."""
    module = _module(roles={"num_solver_samples": 3, "critiques_per_task": 2, "function_task_ratio": 0.0},
                     generation={"max_new_tokens": {"propose": 4, "solve": 4, "critique": 4}})
    scripts = {
        # One valid proposal; one that raises when executed (invalid: the bank task replaces it).
        "propose": ["```python\ndef f(x):\n    return x + 1\n```\nInput: 3\nInput: 10\n",
                    "def f(x):\n    return 1 / 0\nInput: 3\n"],
        # 4 is the executed output; "(4)" is equal after literal_eval in the sandbox; 5 is wrong.
        "solve": ["<answer>4</answer>", "<think>3 plus 1</think><answer>(4)</answer>", "<answer>5</answer>"],
        "critique": ["Verdict: correct", "the answer is wrong. Verdict: incorrect"],
    }
    original = module._generate

    def scripted(role, prompts, num_samples, max_new_tokens, stream=""):
        rollout, texts = original(role, prompts, num_samples, max_new_tokens)
        script = scripts[role]
        return rollout, [script[i % len(script)] for i in range(len(texts))]

    monkeypatch.setattr(module, "_generate", scripted)
    trainer = _trainer(1)
    # The fallback task is f(s) = s[::-1] on 'abc' (executed output 'cba'): every scripted answer is wrong.
    trainer.fit(module, datamodule=CodeTaskDataModule(module.tokenizer, batch_size=2, tasks=["reverse"]))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["train/proposal_valid_rate"] == 0.5
    assert metrics["train/solve_rate"] == pytest.approx(2 / 6)               # 2 of 3 on the proposal, 0 of 3 on the bank task
    assert metrics["train/reward_propose"] == pytest.approx((1 / 3 + 0.0) / 2)  # 1 - 2/3 for the valid one, 0 for the invalid one
    # Critiqued: the first two answers of each task. Proposal: both right, so "correct" agrees and
    # "incorrect" does not; bank task: both wrong, so the other way round.
    assert metrics["train/critique_agreement"] == pytest.approx(0.5)
    assert metrics["train/sandbox_error"] >= 1                               # the 1 / 0 proposal
    assert metrics["train/sandbox_wrong"] >= 1 and metrics["train/sandbox_ok"] >= 1


@pytest.mark.slow
def test_role_adapters_each_role_trains_its_own() -> None:
    module = _module(roles={"adapters": True})
    adapter_of = lambda name: name.split(".")[-2]  # ...lora_A.<adapter>.weight
    lora = {n: p for n, p in module.model.named_parameters() if "lora_" in n}
    assert {adapter_of(n) for n in lora} == {"propose", "solve", "critique"}
    before = {n: p.detach().clone() for n, p in lora.items()}
    _trainer(1).fit(module, datamodule=CodeTaskDataModule(module.tokenizer, batch_size=2))
    changed = {adapter_of(n) for n, p in module.model.named_parameters() if "lora_" in n and not torch.equal(p, before[n])}
    assert changed == {"propose", "solve", "critique"}


# ------------------------------------------------------------------------------- exact under an OOM split
class _CRSPGrads(pl.Callback):
    """The trainable gradients right before the (manual) optimizer step."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module, optimizer) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters() if p.grad is not None}


_LENGTHS: list[int] = []


def _crsp_step(monkeypatch, tmp_path, split: bool, role_adapters: bool = False):
    from lit_memopt.callbacks import MemoryMonitor, OOMRecovery
    from lit_memopt.memory import memory_budget
    from lit_memopt.modules import crsp as crsp_module

    original = crsp_module.response_hidden_states

    def oom_on_more_than_two_rows(model, input_ids, *args, **kwargs):
        # The policy forward of a role's loss runs out of memory on micro-batches of more than 2 sequences.
        if torch.is_grad_enabled():
            _LENGTHS.extend(args[1].sum(dim=-1).tolist())  # response tokens per sequence
        if split and torch.is_grad_enabled() and input_ids.shape[0] > 2:
            with memory_budget(0):
                torch.empty(1024)
        return original(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(crsp_module, "response_hidden_states", oom_on_more_than_two_rows)
    torch.manual_seed(0)
    module = _module(generation={"micro_batch_size": 4}, roles={"adapters": role_adapters})
    with torch.no_grad():
        # A large random EOS embedding (tied head): responses end at varied lengths, so that token and sample
        # weighting differ (with equal lengths a wrong weighting would pass unnoticed).
        eos = module.tokenizer.eos_token_id
        module.model.get_input_embeddings().weight[eos] = 0.3 * torch.randn(ARCH["hidden_size"], generator=torch.Generator().manual_seed(1))
    grads, recovery = _CRSPGrads(), OOMRecovery(grow_after_steps=None)
    trainer = pl.Trainer(max_steps=1, gradient_clip_val=None, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, accelerator="cpu",
                         callbacks=[MemoryMonitor(), recovery, grads],  # the recipe's default callbacks
                         default_root_dir=str(tmp_path))  # MemoryMonitor writes its report there
    trainer.fit(module, datamodule=CodeTaskDataModule(module.tokenizer, batch_size=2))
    return grads.grads, recovery


@pytest.mark.parametrize("role_adapters", [False, True], ids=["one-adapter", "adapter-per-role"])
def test_a_step_split_by_an_oom_equals_the_unsplit_step(role_adapters, monkeypatch, tmp_path) -> None:
    """Token-mean role losses: the pieces of a split micro-batch are weighted by their response tokens (with one
    adapter for every role, and with the recipe's one adapter per role)."""
    unsplit, calm = _crsp_step(monkeypatch, tmp_path, split=False, role_adapters=role_adapters)
    assert len(set(_LENGTHS)) > 2, _LENGTHS  # responses of several lengths
    split, recovery = _crsp_step(monkeypatch, tmp_path, split=True, role_adapters=role_adapters)
    assert calm.oom_events == 0 and recovery.oom_events >= 1  # the split run really was split
    assert unsplit and unsplit.keys() == split.keys()
    if role_adapters:  # every role's adapter got its gradient in the step
        assert {n.split(".")[-2] for n in unsplit if "lora_" in n} == {"propose", "solve", "critique"}
    for name in unsplit:
        torch.testing.assert_close(split[name], unsplit[name], rtol=1e-5, atol=1e-7, msg=name)

"""CRSP rewards, alpha schedule, normaliser, parsing, and the TR-RPG gradient (closed form, clamp)."""

from __future__ import annotations

import math

import pytest
import torch

from lit_memopt.data.code_tasks import TASK_BANK, CodeTaskDataModule, batch_call_program
from lit_memopt.ops import tr_rpg_loss
from lit_memopt.rewards.crsp_rewards import (
    AlphaSchedule,
    RunningNormalizer,
    creativity_score,
    critique_reward,
    length_reward,
    proposer_reward,
    solver_reward,
    think_text,
)


# ------------------------------------------------------------------------------------ TR-RPG
def test_tr_rpg_gradient_closed_form_and_zero_outside_clamp() -> None:
    torch.manual_seed(0)
    clamp, beta = 0.5, 0.05
    logp_old = torch.randn(3, 6, dtype=torch.float64)
    # Log-ratios spread over [-1.2, 1.2]: some inside the clamp, some outside on either side.
    delta = torch.linspace(-1.2, 1.2, 18, dtype=torch.float64).view(3, 6)
    logp_new = (logp_old + delta).requires_grad_(True)
    rewards = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[2, 4:] = False

    loss = tr_rpg_loss(logp_new, logp_old, rewards, beta, mask=mask, clamp=clamp)
    loss.backward()

    log_w = delta.clamp(-clamp, clamp)
    w = log_w.exp()
    r = rewards[:, None].expand_as(delta)
    m = mask.double()
    expected_loss = (w * (beta * log_w - r) * m).sum() / m.sum()
    inside = delta.abs() < clamp
    expected_grad = torch.where(inside, -w * (r - beta * (log_w + 1.0)), torch.zeros_like(delta)) * m / m.sum()
    assert torch.allclose(loss, expected_loss)
    assert torch.allclose(logp_new.grad, expected_grad)
    assert inside.any() and (~inside).any()
    assert (logp_new.grad[~inside] == 0).all()


# ---------------------------------------------------------------------------------- schedule
@pytest.mark.parametrize(
    "progress, expected",
    [(0.0, (0.3, 0.1)), (0.1, (0.3, 0.1)), (0.2, (0.3, 0.1)), (0.4, (0.55, 0.35)), (0.6, (0.8, 0.6)),
     (0.8, (0.875, 0.7)), (1.0, (0.95, 0.8)), (1.5, (0.95, 0.8))],
)
def test_alpha_schedule_breakpoints(progress: float, expected: tuple[float, float]) -> None:
    a_s, a_c = AlphaSchedule()(progress)
    assert a_s == pytest.approx(expected[0]) and a_c == pytest.approx(expected[1])


def test_alpha_schedule_is_cached_per_step() -> None:
    schedule = AlphaSchedule()
    first = schedule.at_step(50, 100)
    schedule.breakpoints = [(0.0, 0.0, 0.0), (1.0, 0.0, 0.0)]  # would change the value if recomputed
    assert schedule.at_step(50, 100) == first == pytest.approx((0.675, 0.475))
    assert schedule.at_step(51, 100) == (0.0, 0.0)
    with pytest.raises(ValueError, match="strictly increasing"):
        AlphaSchedule([(0.5, 0.1, 0.1), (0.2, 0.2, 0.2)])
    with pytest.raises(ValueError, match="alpha_s"):
        AlphaSchedule([(0.0, 1.5, 0.1)])


# ----------------------------------------------------------------------------------- rewards
def test_length_reward_values() -> None:
    assert length_reward(0, 64) == 0.0 and length_reward(1, 64) == 0.0
    assert length_reward(8, 64) == pytest.approx(0.5)                    # ln 8 / ln 64
    assert length_reward(32, 1024) == pytest.approx(0.5)
    assert length_reward(64, 64) == pytest.approx(1.0)
    assert length_reward(100, 1000, penalty_threshold=2000) == pytest.approx(math.log(100) / math.log(1000))
    # Past the threshold: saturated log term times exp(-(n - threshold) / scale).
    assert length_reward(96, 64) == pytest.approx(math.exp(-32 / 32))   # scale defaults to L / 2
    assert length_reward(80, 64, penalty_threshold=70, penalty_scale=5.0) == pytest.approx(math.exp(-2.0))
    with pytest.raises(ValueError, match="max_tokens"):
        length_reward(3, 1)


def test_think_span_and_solver_critique_rewards() -> None:
    assert think_text("<think>abc</think> answer") == "abc"
    assert think_text("<think>a</think>x<think>b</think>") == "a\nb"
    assert think_text("no tags") == "no tags"
    assert solver_reward(1.0, 0.5, 0.3) == pytest.approx(0.3 + 0.7 * 0.5)
    assert solver_reward(0.0, 0.5, 0.95) == pytest.approx(0.05 * 0.5)
    assert critique_reward(1.0, 0.2, 0.1) == pytest.approx(0.1 + 0.9 * 0.2)
    with pytest.raises(ValueError, match="alpha_s"):
        solver_reward(1.0, 0.0, 1.2)


def test_proposer_reward() -> None:
    assert proposer_reward(0, 4) == 0.0      # too hard (or broken)
    assert proposer_reward(4, 4) == 0.0      # too easy
    assert proposer_reward(1, 4) == pytest.approx(0.75)
    assert proposer_reward(3, 4) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="num_correct"):
        proposer_reward(5, 4)


def test_creativity_is_deterministic_and_lexical() -> None:
    text = "the slice s[::-1] reverses the string, so the answer 'cba' is right"
    assert creativity_score(text) == creativity_score(text)
    assert creativity_score("") == 0.0
    looping = creativity_score("correct correct correct correct correct correct correct correct")
    varied = creativity_score(text)
    assert looping < varied <= 1.0
    # Copying a sibling's template costs the novelty half.
    assert creativity_score(text, [text]) == pytest.approx(creativity_score(text) - 0.5)
    assert creativity_score(text, ["a completely different remark about loops"]) > creativity_score(text, [text])


def test_running_normalizer_matches_batch_statistics() -> None:
    torch.manual_seed(0)
    norm = RunningNormalizer(eps=1e-12)
    a, b = torch.randn(5) * 3 + 1, torch.randn(7) - 2
    norm.update(a)
    out = norm.normalize(b)
    both = torch.cat([a, b]).double()
    assert norm.count.item() == 12
    assert norm.mean.item() == pytest.approx(both.mean().item())
    assert norm.std.item() == pytest.approx(both.std(correction=0).item())
    assert torch.allclose(out.double(), (b.double() - both.mean()) / both.std(correction=0), atol=1e-6)
    state = norm.state_dict()
    assert set(state) == {"count", "mean", "m2"}
    fresh = RunningNormalizer()
    assert fresh.normalize(torch.tensor([2.0])).item() == 0.0  # below min_count: only centred


# -------------------------------------------------------------------------------- task bank
def test_task_bank_runs_in_sandbox_and_datamodule() -> None:
    from lit_memopt.rewards.sandbox import Sandbox

    with Sandbox(max_workers=4) as box:
        verdicts = box.run_many([(batch_call_program(t.program, t.inputs), "") for t in TASK_BANK])
    assert all(v.ok for v in verdicts), [(t.name, v.detail) for t, v in zip(TASK_BANK, verdicts) if not v.ok]
    assert verdicts[1].stdout.strip() == "['cba', 'racecar', 'til']"
    dm = CodeTaskDataModule(batch_size=3, num_samples=6)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert [len(b["tasks"]) for b in batches] == [3, 3] and all(t in TASK_BANK for b in batches for t in b["tasks"])
    assert all(TASK_BANK[i] == t for b in batches for i, t in zip(b["task_index"].tolist(), b["tasks"]))
    again = CodeTaskDataModule(batch_size=3, num_samples=6)
    again.setup("fit")
    assert [t.name for b in again.train_dataloader() for t in b["tasks"]] == [t.name for b in batches for t in b["tasks"]]
    with pytest.raises(ValueError, match="unknown names"):
        CodeTaskDataModule(tasks=["nope"])

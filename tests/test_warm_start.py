"""The supervised warm start of the RL recipes: it fits the task family, caches, reloads, and refuses bad input."""

from __future__ import annotations

import pytest
import torch

from lit_memopt.data.reasoning_prompts import ReasoningPromptsDataModule
from lit_memopt.models import ModelConfig
from lit_memopt.modules.sft import next_token_nll
from lit_memopt.modules.warm_start import (
    IGNORE,
    WarmStart,
    _encode,
    backward_by_length,
    fit_examples,
    length_parts,
    warm_start_policy,
)


def _config(layers: int = 2) -> ModelConfig:
    return ModelConfig(name="micro", arch={
        "model_type": "qwen3", "vocab_size": 384, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "max_position_embeddings": 128, "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1})


@pytest.fixture
def setup():
    torch.manual_seed(0)
    cfg = _config()
    tok = cfg.build_tokenizer()
    dm = ReasoningPromptsDataModule(tok, task="strings", num_train=16, num_val=32, max_word_length=3)
    return cfg, tok, dm


def test_examples_are_the_task_family_and_never_the_held_out_prompts(setup):
    _, _, dm = setup
    pairs = dm.warm_start_examples(400, seed=3)
    assert len(pairs) == 400 and pairs == dm.warm_start_examples(400, seed=3)
    held_out = set(dm.val_set.prompts)
    assert not held_out & {p for p, _ in pairs}
    for prompt, answer in pairs:
        word = prompt.split(" ", 1)[1].rstrip("=")
        assert answer == (word if prompt.startswith("copy") else word[::-1])
        assert dm.checker(answer, answer) == 1.0


def test_only_the_answer_and_eos_are_scored(setup):
    cfg, tok, _ = setup
    batch = _encode(tok, [("copy ab=", "ab"), ("reverse abc=", "cba")], torch.device("cpu"))
    for row, labels in zip(batch["input_ids"], batch["labels"]):
        scored = row[labels != IGNORE].tolist()
        assert scored[-1] == tok.eos_token_id
    assert tok.decode(batch["input_ids"][0][batch["labels"][0] != IGNORE][:-1]) == "ab"
    assert tok.decode(batch["input_ids"][1][batch["labels"][1] != IGNORE][:-1]) == "cba"
    # left padding: the shorter row starts with pads that are neither attended nor scored
    assert batch["attention_mask"][0, 0] == 0 and batch["labels"][0, 0] == IGNORE


def test_length_parts_pad_long_rows_apart_only_when_that_saves_work():
    # two lengths far apart: the long rows get a part of their own; every row is in exactly one part
    lengths = [40, 200, 41, 39, 210, 42, 40, 205]
    parts = length_parts(lengths)
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    assert len(parts) >= 2 and {i for i, n in enumerate(lengths) if n > 100} in [set(p) for p in parts]
    # rows of nearly one length: one part, in their own order (another forward would cost more than the
    # padding it saves)
    assert length_parts([20, 21, 22, 20, 23, 21, 20, 22]) == [list(range(8))]
    assert length_parts([5]) == [[0]] and length_parts([]) == [[]]


def test_backward_by_length_gives_the_single_batch_gradient(setup):
    cfg, tok, _ = setup
    torch.manual_seed(1)
    model = cfg.build_model().double()
    short = [("copy ab=", "ab"), ("copy ba=", "ba"), ("copy bb=", "bb")]
    long = [("copy " + w * 30 + "=", w * 30) for w in ("ab", "ba", "bb")]
    pairs = [short[0], long[0], short[1], long[1], short[2], long[2]]
    assert len(length_parts([len(p) + len(a) for p, a in pairs])) == 2  # the split under test happens
    loss = backward_by_length(model, tok, pairs, torch.device("cpu"))
    parted = [p.grad.clone() for p in model.parameters()]
    # Reference: the token mean over the batch, from each row alone (no padding anywhere, so no RoPE
    # position shift between the two computations: they agree to float64 rounding)
    model.zero_grad()
    rows = [next_token_nll(model, _encode(tok, [pair], torch.device("cpu"))) for pair in pairs]
    total = sum(count for _, count in rows)
    whole = sum(mean * count for mean, count in rows) / total
    whole.backward()
    assert loss == pytest.approx(whole.item(), rel=1e-12)
    for a, p in zip(parted, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-10, atol=1e-13)


def test_warm_start_lowers_the_loss_on_fresh_examples(setup):
    cfg, tok, dm = setup
    model = cfg.build_model()
    held = _encode(tok, dm.warm_start_examples(64, seed=999), torch.device("cpu"))
    with torch.no_grad():
        before = next_token_nll(model, held)[0].item()
    losses = fit_examples(model, tok, dm.warm_start_examples, WarmStart(steps=60, lr=3e-3, batch_size=16))
    with torch.no_grad():
        after = next_token_nll(model, held)[0].item()
    assert len(losses) == 60
    assert after < 0.75 * before, (before, after)


def test_weights_are_cached_reused_and_checked(setup, tmp_path):
    cfg, tok, dm = setup
    config = WarmStart(steps=3, batch_size=4)
    model = cfg.build_model()
    message = warm_start_policy(model, tok, dm.warm_start_examples, config, tmp_path)
    assert "3 supervised steps" in message and (tmp_path / "warm_start.pt").is_file()
    fresh = cfg.build_model()
    message = warm_start_policy(fresh, tok, dm.warm_start_examples, config, tmp_path)
    assert message.startswith("warm start: loaded")
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    # cache=False (several processes) neither reads nor writes the file: it trains again
    third = cfg.build_model()
    assert "supervised steps" in warm_start_policy(third, tok, dm.warm_start_examples, config, tmp_path, cache=False)
    # a file of another architecture: a clear error, the file kept
    with pytest.raises(ValueError, match="do not fit this model"):
        warm_start_policy(_config(layers=1).build_model(), tok, dm.warm_start_examples, config, tmp_path)
    assert (tmp_path / "warm_start.pt").is_file()
    assert warm_start_policy(model, tok, dm.warm_start_examples, WarmStart(steps=0), tmp_path) is None


def test_with_lora_the_warm_start_trains_the_base_so_the_reference_is_the_warm_started_model(setup, tmp_path):
    """The reference of a LoRA policy is its base under disable_adapter(): the warm start must change the base
    weights (adapters off), leave the adapters at the identity, and give back which weights need gradients."""
    cfg, tok, dm = setup
    lora = ModelConfig(name="micro", arch=cfg.arch, lora={"r": 4, "alpha": 8})
    model = lora.build_model()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    adapters_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    held = _encode(tok, dm.warm_start_examples(64, seed=999), torch.device("cpu"))
    with torch.no_grad(), model.disable_adapter():
        reference_before = next_token_nll(model, held)[0].item()
    warm_start_policy(model, tok, dm.warm_start_examples, WarmStart(steps=40, lr=3e-3, batch_size=16), tmp_path)
    assert trainable == {n for n, p in model.named_parameters() if p.requires_grad} and all("lora_" in n for n in trainable)
    assert any(not torch.equal(p, base_before[n]) for n, p in model.named_parameters() if "lora_" not in n)
    assert all(torch.equal(p, adapters_before[n]) for n, p in model.named_parameters() if "lora_" in n)
    with torch.no_grad():
        policy = next_token_nll(model, held)[0].item()
        with model.disable_adapter():
            reference = next_token_nll(model, held)[0].item()
    assert policy == reference < 0.8 * reference_before, (policy, reference, reference_before)


def test_bad_settings_are_named(setup, tmp_path):
    cfg, tok, _ = setup
    for bad, name in (({"steps": -1}, "steps"), ({"lr": 0}, "lr"), ({"batch_size": 0}, "batch_size")):
        with pytest.raises(ValueError, match=f"warm_start.{name}"):
            WarmStart.from_any(bad)
    with pytest.raises(ValueError, match="unknown keys"):
        WarmStart.from_any({"stepz": 3})
    with pytest.raises(ValueError, match="mapping"):
        WarmStart.from_any(5)
    with pytest.raises(ValueError, match="warm_start_examples"):
        warm_start_policy(cfg.build_model(), tok, None, WarmStart(steps=2), tmp_path)


def test_the_fit_may_use_more_threads_and_gives_them_back():
    from lit_memopt.modules.warm_start import cpu_threads_at_least, local_cpu_share

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with cpu_threads_at_least(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        with cpu_threads_at_least(1):  # never lowered: a user who asked for more keeps them
            assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), cpu_threads_at_least(None):
            raise RuntimeError("restored on error too")
        torch.set_num_threads(1)
        with pytest.raises(RuntimeError), cpu_threads_at_least(2):
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    from lit_memopt.memory.forked import usable_cpu_cores

    cores = local_cpu_share(1)
    assert cores == usable_cpu_cores()
    assert cores >= 1 and local_cpu_share(2) == max(1, cores // 2) and local_cpu_share(10**6) == 1


def test_guesses_replace_that_share_of_answers_with_random_ones_of_the_same_length():
    tok = _config().build_tokenizer()
    plain = ReasoningPromptsDataModule(tok, task="mixed", num_val=32)
    noisy = ReasoningPromptsDataModule(tok, task="mixed", num_val=32, warm_start_guess_rate=0.3)
    # Rate 0 draws exactly what it drew before the option existed: every answer right.
    for prompt, answer in plain.warm_start_examples(300, seed=5):
        assert answer == _solve(prompt)
    wrong = 0
    for prompt, answer in noisy.warm_start_examples(2000, seed=5):
        truth = _solve(prompt)
        assert len(answer) == len(truth) and answer.lstrip("-").isdigit() == truth.lstrip("-").isdigit()
        wrong += answer != truth
    assert 0.22 < wrong / 2000 < 0.32  # 0.3, less the guesses that happen to be right
    for rate in (-0.5, 1.0):
        with pytest.raises(ValueError, match="data.warm_start_guess_rate"):
            ReasoningPromptsDataModule(tok, warm_start_guess_rate=rate)


def _solve(prompt: str) -> str:
    """The right answer to a compact prompt, worked out independently of the datamodule."""
    question = prompt.rstrip("=")
    if question.startswith(("copy ", "reverse ")):
        task, word = question.split(" ")
        return word if task == "copy" else word[::-1]
    if question.startswith("max("):
        a, b = question[4:-1].split(",")
        return str(max(int(a), int(b)))
    for op, fn in (("+", int.__add__), ("-", int.__sub__), ("*", int.__mul__)):
        if op in question:
            a, b = question.split(op)
            return str(fn(int(a), int(b)))
    raise AssertionError(prompt)

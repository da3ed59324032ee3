"""Shared rollout pieces: sampling layout and EOS masking, log-probs from hidden states vs plain logits
(forward and backward, and vs the sampler's own scores), reference log-probs, group advantages."""

from __future__ import annotations

import copy

import pytest
import torch

from lit_memopt.models import ModelConfig
from lit_memopt.modules.rollout import (
    generate,
    group_advantages,
    masked_mean,
    position_ids_from_mask,
    reference_logprobs,
    sequence_token_logprobs,
)

TEMPERATURE = 0.7


def _config(vocab_size: int = 384, lora: dict | None = None) -> ModelConfig:
    return ModelConfig(
        name="micro",
        arch={
            "model_type": "qwen3",
            "vocab_size": vocab_size,
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


@pytest.fixture(scope="module")
def micro():
    torch.manual_seed(0)
    config = _config()
    return config, config.build_model(), config.build_tokenizer()


def _plain_logprobs(model: torch.nn.Module, input_ids, attention_mask, response_mask, temperature: float) -> torch.Tensor:
    """Full [B, T, V] logits, log_softmax, gather: the obviously correct reference."""
    logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
    out = torch.zeros(input_ids.shape, dtype=logp.dtype)
    out[:, 1:] = logp
    return out * response_mask


def test_generate_layout_and_seed(micro):
    _, model, tok = micro
    rollout = generate(model, ["12+3=", "ab"], tokenizer=tok, num_samples=3, max_new_tokens=6, temperature=TEMPERATURE, seed=5)
    again = generate(model, ["12+3=", "ab"], tokenizer=tok, num_samples=3, max_new_tokens=6, temperature=TEMPERATURE, seed=5)
    assert torch.equal(rollout.input_ids, again.input_ids)
    assert rollout.input_ids.shape[0] == 6 and rollout.prompt_length == 5
    prompts = rollout.input_ids[:, : rollout.prompt_length]
    # Samples of one prompt are contiguous; the short prompt is left-padded.
    assert torch.equal(prompts[0], prompts[2]) and torch.equal(prompts[3], prompts[5])
    assert prompts[3].tolist() == [0, 0, 0] + [ord("a") + 3, ord("b") + 3]
    assert rollout.attention_mask[3, :3].sum() == 0
    assert not rollout.response_mask[:, : rollout.prompt_length].any()
    assert rollout.response_lengths.min() >= 1


def test_greedy_generate_takes_the_argmax_at_every_step(micro):
    _, model, tok = micro
    rollout = generate(model, ["12+3=", "ab"], tokenizer=tok, max_new_tokens=5, greedy=True, eos_token_id=-1)
    ids, attn = rollout.input_ids[:, : rollout.prompt_length], rollout.attention_mask[:, : rollout.prompt_length]
    with torch.no_grad():  # the plain loop: full forward, argmax, append
        for _ in range(5):
            logits = model(ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
    assert torch.equal(rollout.input_ids, ids)
    with pytest.raises(ValueError, match="num_samples must be 1"):
        generate(model, ["ab"], tokenizer=tok, num_samples=2, greedy=True)


def test_generate_masks_after_first_eos():
    torch.manual_seed(0)
    config = _config(vocab_size=6)  # EOS (id 1) is likely at every step
    model = config.build_model()
    prompts = torch.tensor([[2, 3, 4], [0, 5, 2]])
    rollout = generate(model, prompts, attention_mask=(prompts != 0).long(), num_samples=4, max_new_tokens=12, eos_token_id=1, pad_token_id=0, seed=0)
    response = rollout.response_ids
    mask = rollout.response_mask[:, rollout.prompt_length :]
    stopped = 0
    for row in range(response.shape[0]):
        eos = (response[row] == 1).nonzero()
        if len(eos):
            first = int(eos[0])
            stopped += first < response.shape[1] - 1
            assert mask[row, : first + 1].all() and not mask[row, first + 1 :].any()
        else:
            assert mask[row].all()
    assert stopped > 0, "the test needs at least one response that stopped early"
    assert torch.equal(rollout.attention_mask[:, rollout.prompt_length :].bool(), mask)


def test_sequence_logprobs_match_plain_logits_forward_and_backward(micro):
    _, model, tok = micro
    rollout = generate(model, ["7*8=", "copy ab"], tokenizer=tok, num_samples=2, max_new_tokens=5, temperature=TEMPERATURE, seed=1)
    args = (rollout.input_ids, rollout.attention_mask, rollout.response_mask)
    fused = sequence_token_logprobs(model, *args, temperature=TEMPERATURE, chunk_size=7)
    weights = torch.randn(fused.shape)
    (fused * weights).sum().backward()
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plain = _plain_logprobs(model, *args, TEMPERATURE)
    (plain * weights).sum().backward()
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    assert (fused[~rollout.response_mask] == 0).all()
    for name, param in model.named_parameters():
        torch.testing.assert_close(fused_grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)
    model.zero_grad()


def test_logprobs_are_those_of_the_sampler(micro):
    """Recomputed log-probs (left padding handled by position ids) equal transformers' sampling scores."""
    _, model, _ = micro
    prompts = torch.tensor([[0, 0, 40, 41, 42], [50, 51, 52, 53, 54]])
    attention = (prompts != 0).long()
    with torch.no_grad():
        out = model.generate(input_ids=prompts, attention_mask=attention, do_sample=True, top_k=0, temperature=TEMPERATURE, max_new_tokens=6,
                             output_scores=True, return_dict_in_generate=True, eos_token_id=1, pad_token_id=0)
    sampler = torch.log_softmax(torch.stack(out.scores, dim=1), dim=-1).gather(-1, out.sequences[:, 5:, None])[..., 0]
    full_attention = torch.cat([attention, torch.ones(2, 6, dtype=torch.long)], dim=1)
    response_mask = torch.zeros_like(full_attention, dtype=torch.bool)
    response_mask[:, 5:] = True  # tokens after an EOS are scored too: both sides see the same prefix
    with torch.no_grad():
        fused = sequence_token_logprobs(model, out.sequences, full_attention, response_mask, temperature=TEMPERATURE)
    torch.testing.assert_close(fused[:, 5:], sampler, atol=1e-5, rtol=1e-5)


def test_reference_logprobs_share_base_weights_and_chunk():
    torch.manual_seed(0)
    config = _config(lora={"r": 4, "alpha": 8})
    base = config.build_model(apply_lora=False)
    frozen = copy.deepcopy(base)
    policy = config.apply_lora(base)
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)  # make the adapter matter
    prompts = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    rollout = generate(policy, prompts, num_samples=2, max_new_tokens=4, eos_token_id=1, pad_token_id=0, seed=3)
    args = (rollout.input_ids, rollout.attention_mask, rollout.response_mask)
    shared = reference_logprobs(policy, *args, temperature=TEMPERATURE, micro_batch_size=4)
    assert not shared.requires_grad
    with torch.no_grad():
        expected = sequence_token_logprobs(frozen, *args, temperature=TEMPERATURE)
        adapted = sequence_token_logprobs(policy, *args, temperature=TEMPERATURE)
    torch.testing.assert_close(shared, expected, atol=1e-6, rtol=1e-6)
    assert (adapted - expected).abs().max() > 1e-3  # the adapter is back on after the reference pass
    separate = reference_logprobs(policy, *args, reference_model=frozen, temperature=TEMPERATURE, micro_batch_size=1)
    torch.testing.assert_close(separate, expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="reference_model"):
        reference_logprobs(frozen, *args)
    with pytest.raises(ValueError, match="micro_batch_size"):
        reference_logprobs(policy, *args, micro_batch_size=0)


def test_group_advantages_zero_mean_unit_std_per_group():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0, -1.0, 0.5, 4.0, 2.0])
    adv = group_advantages(rewards, group_size=4).view(3, 4)
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv[[0, 2]].std(dim=1, correction=0), torch.ones(2), atol=1e-4, rtol=0)
    assert (adv[1] == 0).all()  # equal rewards carry no signal
    plain = (rewards[:4] - rewards[:4].mean()) / (rewards[:4].std(correction=0) + 1e-6)
    torch.testing.assert_close(adv[0], plain)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(rewards, group_size=5)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(rewards, group_size=0)


def test_group_advantages_without_std_scaling_are_the_centred_rewards():
    """``scale="none"`` (Dr. GRPO): a group that differs by little moves the policy by little."""
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0, 0.01, 0.0, 0.0, 0.03])
    adv = group_advantages(rewards, group_size=4, scale="none").view(3, 4)
    grouped = rewards.view(3, 4)
    torch.testing.assert_close(adv, grouped - grouped.mean(dim=1, keepdim=True))
    assert adv[2].abs().max() < 0.03  # against about 1.4 with the group std scaling
    assert group_advantages(rewards, group_size=4).view(3, 4)[2].abs().max() > 1.0
    with pytest.raises(ValueError, match="scale_rewards='batch'"):
        group_advantages(rewards, group_size=4, scale="batch")


def test_identical_responses_share_one_reward_and_rounding_is_no_signal():
    from lit_memopt.modules.rollout import Rollout, share_rewards_of_identical_responses

    # Two groups of 4, prompt length 1. Group 0: rows 0, 1, 3 identical (row 3 differs only after its EOS=1,
    # which the response mask hides); group 1: all distinct.
    ids = torch.tensor([[5, 7, 8, 1], [5, 7, 8, 1], [5, 7, 9, 1], [5, 7, 8, 1],
                        [6, 2, 3, 1], [6, 3, 3, 1], [6, 4, 3, 1], [6, 5, 3, 1]])
    response = torch.ones_like(ids, dtype=torch.bool)
    response[:, 0] = False
    ids[3, 3] = 1
    rollout = Rollout(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=response, prompt_length=1, num_samples=4)
    rewards = torch.tensor([9.5, 9.5 + 3e-6, 9.0, 9.5 - 1e-6, 1.0, 2.0, 3.0, 4.0])
    shared = share_rewards_of_identical_responses(rewards, rollout)
    assert shared[0] == shared[1] == shared[3]
    torch.testing.assert_close(shared[0], torch.tensor(9.5 + 2e-6 / 3), rtol=0, atol=1e-6)
    assert shared[2] == 9.0 and torch.equal(shared[4:], rewards[4:])
    # A group of identical responses: one reward, so zero advantages (rounding in the mean is a tie too).
    same = Rollout(input_ids=ids[:1].repeat(4, 1), attention_mask=torch.ones(4, 4), response_mask=response[:4],
                   prompt_length=1, num_samples=4)
    noisy = torch.tensor([10.1, 10.1 + 2e-6, 10.1 - 2e-6, 10.1 + 1e-6])
    assert group_advantages(noisy, 4, tie_tolerance=0.0).abs().max() > 0.5  # what rounding noise would do alone
    assert (group_advantages(share_rewards_of_identical_responses(noisy, same), 4) == 0).all()
    # Real differences keep their advantages, even tiny ones of a near-uniform (random-init) policy.
    tiny = torch.tensor([0.0712, 0.0713, 0.0711, 0.0712])
    torch.testing.assert_close(group_advantages(tiny, 4), (tiny - tiny.mean()) / (tiny.std(correction=0) + 1e-6))


def test_masked_mean_and_argument_errors(micro):
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, False, True], [False, False, False]])
    assert masked_mean(values, mask).item() == 2.0
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([2.0, 0.0]))
    _, model, tok = micro
    with pytest.raises(ValueError, match="num_samples"):
        generate(model, ["a"], tokenizer=tok, num_samples=0)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, ["a"], tokenizer=tok, temperature=0.0)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, ["a"])

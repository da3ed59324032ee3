"""Shared model helpers: left padding, LoRA adapter contexts (written once, used by data, rollout, GRADE, CRSP)."""

from __future__ import annotations

import pytest
import torch

from lit_memopt.models.adapters import active_adapter, is_peft_model, reference_model
from lit_memopt.models.tokens import left_pad


def _naive_left_pad(rows: list[list[int]], pad_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [[pad_id] * (length - len(r)) + r for r in rows]
    mask = [[0] * (length - len(r)) + [1] * len(r) for r in rows]
    return torch.tensor(ids), torch.tensor(mask)


@pytest.mark.parametrize("length", [None, 7])
def test_left_pad_matches_a_plain_reference(length: int | None) -> None:
    rows = [[5, 6, 7], [8], [], [1, 2, 3, 4]]
    ids, mask = left_pad(rows, pad_id=0, length=length)
    want_ids, want_mask = _naive_left_pad(rows, 0, length or 4)
    assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask)
    assert ids.dtype == mask.dtype == torch.long


def test_left_pad_refuses_rows_longer_than_length() -> None:
    with pytest.raises(ValueError, match="more than length=2"):
        left_pad([[1, 2, 3]], pad_id=0, length=2)


def _tiny_lora():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    lora = dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(Qwen3ForCausalLM(config), LoraConfig(**lora))
    model.add_adapter("critique", LoraConfig(**lora))
    return model


def test_active_adapter_restores_the_previous_adapter() -> None:
    model = _tiny_lora()
    assert model.active_adapter == "default"
    with active_adapter(model, "critique"):
        assert model.active_adapter == "critique"
    assert model.active_adapter == "default"
    with pytest.raises(RuntimeError), active_adapter(model, "critique"):
        raise RuntimeError("a failing block")
    assert model.active_adapter == "default"  # restored on errors too


def test_reference_model_is_the_copy_or_the_policy_without_adapters() -> None:
    model = _tiny_lora()
    assert is_peft_model(model)
    copy = torch.nn.Linear(2, 2)
    with reference_model(model, copy) as ref:
        assert ref is copy
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        # LoRA B starts at zero: give it weights, so that disabling the adapter visibly changes the output.
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.5)
        with_adapter = model(input_ids=ids).logits
        with reference_model(model) as ref:
            base = ref(input_ids=ids).logits
    assert not torch.allclose(with_adapter, base)
    with pytest.raises(ValueError, match="not a peft model"), reference_model(torch.nn.Linear(2, 2)):
        pass

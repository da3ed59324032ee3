"""SFT with the fused head equals plain transformers cross-entropy, loss and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_memopt.data.synthetic_text import SyntheticTextDataModule
from lit_memopt.models import ModelConfig
from lit_memopt.modules import SFTModule

ARCH = dict(model_type="qwen3", vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)


def _naive_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=-100)


@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8}])
def test_fused_sft_loss_and_grads_match_transformers(lora: dict | None) -> None:
    cfg = ModelConfig(name="t", arch=ARCH, lora=lora)
    data = SyntheticTextDataModule(cfg.build_tokenizer(), num_train=8, num_val=4, seq_len=40, batch_size=4)
    batch = next(iter(data.train_dataloader()))
    batch["labels"][0, 25:] = -100  # unlabelled tokens (prompt or padding) must not count
    module = SFTModule(cfg, lr=1e-3)
    fused = module(batch)
    fused.backward()
    fused_grads = {n: p.grad.clone() for n, p in module.model.named_parameters() if p.requires_grad}
    module.model.zero_grad()
    naive = _naive_loss(module.model, batch)
    naive.backward()
    torch.testing.assert_close(fused, naive, rtol=1e-5, atol=1e-5)
    for name, p in module.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(fused_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_bad_arguments_are_named() -> None:
    cfg = ModelConfig(name="t", arch=ARCH)
    with pytest.raises(ValueError, match="module.lr"):
        SFTModule(cfg, lr=0.0)
    with pytest.raises(ValueError, match="data.task"):
        SyntheticTextDataModule(cfg.build_tokenizer(), task="poetry")
    with pytest.raises(ValueError, match="model.dtype"):
        ModelConfig(name="t", arch=ARCH, dtype="float8")
    with pytest.raises(ValueError, match="model.arch.model_type"):
        ModelConfig(name="t", arch={})
    with pytest.raises(FileNotFoundError, match="model.pretrained"):
        ModelConfig(name="t", arch=ARCH, pretrained="/nonexistent/ckpt").build_model()


def test_fake_peak_counts_models_with_frozen_parameters() -> None:
    """peak_during works on LoRA-style models (frozen base) and counts the same activations."""
    from lit_memopt.memory import fake_mode, peak_during

    def measure(freeze: bool) -> int:
        with fake_mode():
            net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
            if freeze:
                net[0].weight.requires_grad_(False)
            x = torch.randn(64, 256, requires_grad=True)
            return peak_during(lambda: net(x).sum().backward(), net, x).extra_bytes

    frozen, trainable = measure(True), measure(False)
    # Freezing the first weight removes its gradient (1024 x 256 fp32) and nothing else: the peak
    # drops, by no more than that gradient's size.
    assert 0 < trainable - frozen <= 1024 * 256 * 4

"""TTT LM, integration into a transformers causal LM, recall data, and TTTModule training steps."""

from __future__ import annotations

import pytest
import torch

from lit_memopt.data.recall import IGNORE_INDEX, RecallDataModule
from lit_memopt.models import ModelConfig
from lit_memopt.models.ttt import (
    AttentionWithTTT,
    GatedTTT,
    TTTConfig,
    TTTIntegrationConfig,
    TTTLinear,
    TTTMLP,
    add_ttt_layers,
    ttt_branches,
)
from lit_memopt.modules.ttt import TTTModule

HOST_ARCH = {
    "model_type": "qwen3",
    "vocab_size": 384,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


def _host_config() -> ModelConfig:
    return ModelConfig(name="host", arch=dict(HOST_ARCH))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_integration_at_gate_zero_leaves_outputs_unchanged_and_gate_opens():
    torch.manual_seed(0)
    model = _host_config().build_model().eval()
    ids = torch.randint(3, 384, (2, 21))
    before = _logits(model, ids)
    branches = add_ttt_layers(model, {"layers": [0, -1], "gate_init": 0.0, "mini_batch_size": 4})
    assert len(branches) == 2 and len(ttt_branches(model)) == 2
    layers = model.model.layers
    assert isinstance(layers[0].self_attn, AttentionWithTTT) and isinstance(layers[2].self_attn, AttentionWithTTT)
    assert not isinstance(layers[1].self_attn, AttentionWithTTT)
    assert layers[0].self_attn.layer_idx == 0  # attribute reads reach the wrapped attention
    assert torch.equal(_logits(model, ids), before)
    # the branch is live: a non-zero gate changes the output, and gradients reach the gate at 0
    model.train()
    out = model(input_ids=ids).logits
    out.square().mean().backward()
    assert branches[0].gate.grad is not None and branches[0].gate.grad.abs().sum() > 0
    with torch.no_grad():
        branches[0].gate.fill_(0.5)
    assert not torch.allclose(_logits(model.eval(), ids), before)


def test_gated_branch_is_identity_at_zero():
    from lit_memopt.models.ttt import TTTLinear

    branch = GatedTTT(TTTLinear(16, 2, mini_batch_size=4), gate_init=0.0)
    x = torch.randn(2, 9, 16)
    assert torch.equal(branch(x), x)


def test_branches_plan_auto_checkpointing_together_and_take_the_paper_learning_rate():
    """Each inserted layer is built knowing how many branches share the memory budget of
    ``checkpoint_group_size="auto"``, and with the paper's ``eta_base`` for its type."""
    for layer_type, base_lr in (("linear", TTTLinear.paper_base_lr), ("mlp", TTTMLP.paper_base_lr)):
        model = _host_config().build_model()
        config = {"layers": [0, -1], "layer_type": layer_type, "mini_batch_size": 4, "checkpoint_group_size": "auto"}
        branches = add_ttt_layers(model, config)
        assert [(b.ttt.auto_num_layers, b.ttt.base_lr) for b in branches] == [(2, base_lr), (2, base_lr)]


def test_add_ttt_layers_rejects_bad_layer_index():
    model = _host_config().build_model()
    with pytest.raises(ValueError, match="integration.layers"):
        add_ttt_layers(model, TTTIntegrationConfig(layers=[3]))
    with pytest.raises(ValueError, match="layer_type"):
        TTTIntegrationConfig(layer_type="attention")


def test_recall_data_layout_and_determinism():
    tok = TTTConfig().build_tokenizer()
    dm = RecallDataModule(tok, num_pairs=4, num_queries=3, batch_size=5, train_size=20, val_size=10)
    dm.setup("fit")
    sample = dm.train_set[7]
    ids, labels = sample["input_ids"], sample["labels"]
    assert ids.shape == labels.shape == (14,)
    pairs = dict(zip(ids[0:8:2].tolist(), ids[1:8:2].tolist()))
    assert len(pairs) == 4  # distinct keys
    for pos in range(8, 14, 2):
        key, answer = ids[pos].item(), ids[pos + 1].item()
        assert pairs[key] == answer and labels[pos].item() == answer
    assert (labels[labels != IGNORE_INDEX].numel()) == 3
    assert torch.equal(dm.train_set[7]["input_ids"], ids)  # generated from the index alone
    assert not torch.equal(dm.val_set[7]["input_ids"], ids)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (5, 14)
    with pytest.raises(ValueError, match="key_alphabet"):
        RecallDataModule(tok, num_pairs=5, key_alphabet="ABC")
    with pytest.raises(ValueError, match="num_queries"):
        RecallDataModule(tok, num_queries=0)


def _loss_reference(module, batch):
    """Plain cross-entropy on the labelled positions with full logits."""
    hidden = module.hidden_states(batch["input_ids"])
    logits = hidden @ module.head_weight().T
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("mode", ["ttt_lm", "integration"])
def test_module_loss_matches_plain_cross_entropy_and_optimizer_groups(mode):
    torch.manual_seed(0)
    tok = TTTConfig().build_tokenizer()
    if mode == "ttt_lm":
        config = TTTConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, mini_batch_size=4)
        module = TTTModule(config, tok, lr=1e-3)
    else:
        module = TTTModule(
            _host_config(), tok, lr=1e-3, base_lr=1e-5, integration={"layers": [1], "mini_batch_size": 4}
        )
    dm = RecallDataModule(tok, num_pairs=3, num_queries=3, batch_size=4, train_size=8, val_size=4)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    loss, acc, count = module._loss_and_accuracy(batch)
    torch.testing.assert_close(loss, _loss_reference(module, batch), rtol=1e-5, atol=1e-5)
    assert count == 12 and 0.0 <= acc.item() <= 1.0
    loss.backward()
    groups = {g["name"]: g for g in module.parameter_groups()}
    if mode == "integration":
        assert {g["lr"] for n, g in groups.items() if n.startswith("host")} == {1e-5}
        assert {g["lr"] for n, g in groups.items() if n.startswith("ttt")} == {1e-3}
        new = {id(p) for b in module.branches for p in b.parameters()}
        assert new == {id(p) for n, g in groups.items() if n.startswith("ttt") for p in g["params"]}
    else:
        assert all(g["lr"] == 1e-3 for g in groups.values())


def test_integration_base_lr_zero_freezes_host():
    tok = TTTConfig().build_tokenizer()
    from omegaconf import OmegaConf

    # Hydra hands the integration block over as a DictConfig
    integration = OmegaConf.create({"layers": [0], "gate_init": 0.0, "checkpoint_group_size": "auto"})
    module = TTTModule(_host_config(), tok, base_lr=0.0, integration=integration)
    assert module.integration.layers == [0] and module.branches[0].ttt.checkpoint_group_size == "auto"
    trainable = [p for p in module.model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for b in module.branches for p in b.parameters()}
    assert all(g["name"].startswith("ttt") for g in module.parameter_groups())


def test_module_fit_two_steps_with_lightning(tmp_path):
    import lightning.pytorch as pl

    tok = TTTConfig().build_tokenizer()
    config = TTTConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, mini_batch_size=4,
                       checkpoint_group_size=1)
    module = TTTModule(config, tok, lr=1e-3, warmup_steps=1)
    dm = RecallDataModule(tok, num_pairs=3, num_queries=2, batch_size=4, train_size=16, val_size=4)
    trainer = pl.Trainer(max_steps=2, limit_val_batches=1, val_check_interval=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=dm)
    metrics = trainer.callback_metrics
    for key in ("train/loss", "train/recall_acc", "val/loss", "val/recall_acc"):
        assert key in metrics and torch.isfinite(metrics[key])
    with pytest.raises(ValueError, match="module.lr"):
        TTTModule(config, tok, lr=0.0)

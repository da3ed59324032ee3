"""``lit-memopt export`` and ``fit ... export=DIR``: a run's model as a Hugging Face folder.

Each exported folder is loaded the way a user loads it (``AutoModelForCausalLM``, ``AutoTokenizer``, peft's
``PeftModel``) and its float32 logits are compared with the trained weights, read from the Lightning checkpoint
into a model the test builds itself (not through the export code). One fit run per kind is shared by the tests.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from test_cli import run_cli

from lit_memopt import cli

LORA = "model.lora={r:4,alpha:8,dropout:0.0,target_modules:[q_proj,v_proj]}"
TINY = ["recipe=sft", "trainer.max_steps=3", "data.num_train=64", "data.num_val=16", "data.seq_len=32",
        "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false",
        "module.warmup_steps=0"]  # full learning rate from the first step: the trained weights clearly move
FSDP2 = ["trainer=fsdp2", "trainer.devices=2", "trainer.accelerator=cpu"]
TEXT = "What is 3+4? 7 Copy abc. abc"


def _fit(tmp: Path, user_checkpoint: Path, *extra: str, timeout: int = 200) -> Path:
    run_dir = tmp / "run"
    result = run_cli(["fit", *TINY, f"model.pretrained={user_checkpoint}", *extra, f"hydra.run.dir={run_dir}"],
                     cwd=tmp, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def _export(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["export", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def _reported_diff(out: str) -> float:
    match = re.search(r"largest \|logit difference\| from the trained model (\S+) \(float32", out)
    assert match, out
    return float(match.group(1))


def _ids(user_checkpoint: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(user_checkpoint)(TEXT, return_tensors="pt")["input_ids"]


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model.eval()(input_ids=ids).logits.float()


def _module_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LightningModule's ``model.`` entries, prefix stripped (what the trained network holds)."""
    return {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}


def _trained_model(user_checkpoint: Path, state: dict[str, torch.Tensor], lora: bool = False) -> torch.nn.Module:
    """The trained network rebuilt by the test itself: the user's checkpoint, LoRA as the run had it, the weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(user_checkpoint, dtype=torch.float32)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    model.load_state_dict(_module_weights(state), strict=True)
    return model


def _ckpt_state(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def _load_folder(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


# ----------------------------------------------------------------------------- shared runs
@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory, user_checkpoint: Path) -> Path:
    """Full fine-tuning on one device, with ``export=`` so the same run checks the end-of-fit export."""
    tmp = tmp_path_factory.mktemp("sft")
    return _fit(tmp, user_checkpoint, f"export={tmp / 'run' / 'hf'}")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, user_checkpoint: Path) -> Path:
    return _fit(tmp_path_factory.mktemp("lora"), user_checkpoint, LORA)


# ----------------------------------------------------------------------------- tests
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_export_of_a_single_file_checkpoint_loads_with_auto_classes(sft_run: Path, user_checkpoint: Path,
                                                                    tmp_path: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    from _user_assets import CHAT_TEMPLATE

    out = tmp_path / "hf"
    # the real console command in its own process: exit code 0, the reload check printed
    result = run_cli(["export", f"ckpt_path={sft_run / 'checkpoints' / 'last.ckpt'}", f"out={out}"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _reported_diff(result.stdout) <= 1e-5
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}

    ids = _ids(user_checkpoint)
    trained = _logits(_trained_model(user_checkpoint, _ckpt_state(sft_run / "checkpoints" / "last.ckpt")), ids)
    exported = _logits(_load_folder(out), ids)
    torch.testing.assert_close(exported, trained, atol=1e-5, rtol=0)
    untrained = _logits(_load_folder(user_checkpoint), ids)
    assert (exported - untrained).abs().max() > 1e-2  # the export holds the trained weights, not the starting ones

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "What is 1+2?"}]
    original = AutoTokenizer.from_pretrained(user_checkpoint)
    assert tokenizer.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(messages, tokenize=False)
    generation = GenerationConfig.from_pretrained(out)
    assert (generation.eos_token_id, generation.pad_token_id) == (original.eos_token_id, original.pad_token_id)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_fit_with_export_writes_the_final_model(sft_run: Path, user_checkpoint: Path) -> None:
    from safetensors.torch import load_file

    folder = sft_run / "hf"
    meta = torch.load(sft_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert meta["global_step"] == 3  # the checkpoint is the final state, so both must hold the same weights
    written = load_file(folder / "model.safetensors")
    expected = _module_weights(meta["state_dict"])
    for key, value in written.items():
        assert torch.equal(value, expected[key]), key
    ids = _ids(user_checkpoint)
    torch.testing.assert_close(_logits(_load_folder(folder), ids), _logits(_trained_model(user_checkpoint, meta["state_dict"]), ids),
                               atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_lora_is_merged_by_default_and_written_as_an_adapter_on_request(lora_run: Path, user_checkpoint: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = lora_run / "checkpoints" / "last.ckpt"
    state = _ckpt_state(ckpt)
    ids = _ids(user_checkpoint)
    peft_model = _trained_model(user_checkpoint, state, lora=True)
    trained = _logits(peft_model, ids)
    with peft_model.disable_adapter():
        assert (_logits(peft_model, ids) - trained).abs().max() > 1e-4  # the adapters learned something to merge

    merged = tmp_path / "merged"
    code, out, err = _export(f"ckpt_path={ckpt}", f"out={merged}", capsys=capsys)
    assert code == 0, err
    assert "LoRA default merged" in out and _reported_diff(out) <= 1e-5
    model = _load_folder(merged)
    assert not any("lora" in name for name, _ in model.named_parameters())
    torch.testing.assert_close(_logits(model, ids), trained, atol=1e-5, rtol=0)

    adapter = tmp_path / "adapter"
    code, out, err = _export(f"ckpt_path={ckpt}", f"out={adapter}", "lora=adapter", capsys=capsys)
    assert code == 0, err
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "model.safetensors").exists()
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(user_checkpoint)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(user_checkpoint, dtype=torch.float32), adapter)
    torch.testing.assert_close(_logits(reloaded, ids), trained, atol=1e-5, rtol=0)

    # overwrite=true replaces an earlier export's files (no stale shards) and keeps the user's own
    (merged / "notes.txt").write_text("mine")
    code, out, err = _export(f"ckpt_path={ckpt}", f"out={merged}", "lora=adapter", "overwrite=true", capsys=capsys)
    assert code == 0, err
    assert "removed" in out and (merged / "notes.txt").read_text() == "mine"
    assert not (merged / "model.safetensors").exists() and (merged / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_several_adapters_need_a_name_to_merge(lora_run: Path, user_checkpoint: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # CRSP's role adapters, made from the LoRA run: "solve" is the trained adapter, "propose" a zeroed copy
    state = _ckpt_state(lora_run / "checkpoints" / "last.ckpt")
    roles = {}
    for key, value in state.items():
        if ".default." in key:
            roles[key.replace(".default.", ".solve.")] = value
            roles[key.replace(".default.", ".propose.")] = torch.zeros_like(value)
        else:
            roles[key] = value
    run = tmp_path / "roles"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(lora_run / ".hydra", run / ".hydra")
    torch.save({"state_dict": roles}, run / "checkpoints" / "last.ckpt")

    code, _, err = _export(f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"out={tmp_path / 'a'}", capsys=capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert "merging needs adapter=NAME" in err and "solve, propose" in err
    code, _, err = _export(f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"out={tmp_path / 'b'}", "adapter=solve",
                           capsys=capsys)
    assert code == 0, err
    ids = _ids(user_checkpoint)
    trained = _logits(_trained_model(user_checkpoint, state, lora=True), ids)
    torch.testing.assert_close(_logits(_load_folder(tmp_path / "b"), ids), trained, atol=1e-5, rtol=0)

    # lora=adapter writes every adapter, each in peft's own layout (a sub-folder per named adapter)
    code, out, err = _export(f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"out={tmp_path / 'c'}", "lora=adapter",
                             capsys=capsys)
    assert code == 0, err
    assert "LoRA adapters solve, propose" in out and _reported_diff(out) <= 1e-5
    assert (tmp_path / "c" / "solve" / "adapter_config.json").is_file()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(user_checkpoint, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "c" / "solve")
    torch.testing.assert_close(_logits(reloaded, ids), trained, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fsdp2_sharded_checkpoint_and_fit_export(tmp_path: Path, user_checkpoint: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = _fit(tmp_path, user_checkpoint, *FSDP2, f"export={tmp_path / 'fit-hf'}", timeout=240)
    sharded = run / "checkpoints" / "last.ckpt"
    assert sharded.is_dir() and (sharded / ".metadata").is_file()
    assert torch.load(sharded / "meta.pt", weights_only=False)["global_step"] == 3  # the final state

    code, out, err = _export(f"ckpt_path={sharded}", f"out={tmp_path / 'hf'}", capsys=capsys)
    assert code == 0, err
    assert _reported_diff(out) <= 1e-5

    # the same weights consolidated by torch's own converter, into a model the test builds
    dcp_to_torch_save(sharded, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)["state_dict"]
    ids = _ids(user_checkpoint)
    trained = _logits(_trained_model(user_checkpoint, full), ids)
    assert (trained - _logits(_load_folder(user_checkpoint), ids)).abs().max() > 1e-2
    torch.testing.assert_close(_logits(_load_folder(tmp_path / "hf"), ids), trained, atol=1e-5, rtol=0)
    # fit ... export= under FSDP2: the full state dict gathered on rank zero after training
    torch.testing.assert_close(_logits(_load_folder(tmp_path / "fit-hf"), ids), trained, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_bad_inputs_fail_in_one_line(sft_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = sft_run / "checkpoints" / "last.ckpt"
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep me")
    moved = tmp_path / "moved" / "last.ckpt"
    moved.parent.mkdir()
    shutil.copy(ckpt, moved)
    cases = [
        ([f"out={tmp_path / 'o'}"], "export needs ckpt_path="),
        ([f"ckpt_path={ckpt}"], "export needs out="),
        ([f"ckpt_path={tmp_path / 'nope.ckpt'}", f"out={tmp_path / 'o'}"], "does not exist"),
        ([f"ckpt_path={ckpt}", f"out={full}"], "is not empty"),
        ([f"ckpt_path={ckpt}", f"out={tmp_path / 'o'}", "lora=squash"], "unknown lora='squash'; choose one of: merge, adapter"),
        ([f"ckpt_path={ckpt}", f"outt={tmp_path / 'o'}"], "did you mean 'out'"),
        ([f"ckpt_path={moved}", f"out={tmp_path / 'o'}"], "no run config found"),
        ([f"ckpt_path={moved.parent}", f"out={tmp_path / 'o'}", f"config={sft_run / '.hydra' / 'config.yaml'}"],
         "not a sharded checkpoint"),
        ([f"ckpt_path={ckpt}", f"out={tmp_path / 'o'}", "lora=adapter"], "trained no LoRA adapters"),
    ]
    for args, expected in cases:
        code, _, err = _export(*args, capsys=capsys)
        assert code == 2, (args, err)
        assert err.startswith("lit-memopt: error:") and len(err.splitlines()) == 1, err
        assert expected in err, err
    assert [p.name for p in full.iterdir()] == ["mine.txt"]  # nothing of the user's was touched
    assert not (tmp_path / "o").exists()
    # a moved checkpoint exports with its config named explicitly
    code, _, err = _export(f"ckpt_path={moved}", f"out={tmp_path / 'o'}", f"config={sft_run / '.hydra' / 'config.yaml'}",
                           capsys=capsys)
    assert code == 0, err


def test_a_model_that_is_not_a_transformers_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from omegaconf import OmegaConf

    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    OmegaConf.save(cli.compose_config(["recipe=ttt"]), tmp_path / "run" / ".hydra" / "config.yaml")
    ckpt = tmp_path / "run" / "last.ckpt"
    torch.save({"state_dict": {"model.lm_head.weight": torch.zeros(2, 2), "reference.w": torch.zeros(1)}}, ckpt)
    code, _, err = _export(f"ckpt_path={ckpt}", f"out={tmp_path / 'o'}", capsys=capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "is a TTTForCausalLM, not a transformers PreTrainedModel" in err


@pytest.mark.slow
@pytest.mark.timeout(40)
def test_fit_with_export_to_a_full_folder_stops_before_training(tmp_path: Path, user_checkpoint: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("")
    result = run_cli(["fit", *TINY, f"model.pretrained={user_checkpoint}", f"export={tmp_path / 'hf'}",
                      f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("lit-memopt: error: out=")
    assert "is not empty" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # it never trained


def test_a_character_tokenizer_model_exports_in_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A random-init toy model (no checkpoint, the CharTokenizer) through export_model: several safetensors shards."""
    from hydra.utils import instantiate

    from lit_memopt.export import export_model
    from lit_memopt.models import CharTokenizer

    cfg = cli.compose_config(["recipe=sft", "model=tiny_qwen3_strings"])
    model = instantiate(cfg.model).build_model()
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.5)  # not what a fresh build gives
    diff = export_model(cfg.model, model.state_dict(), tmp_path / "o", max_shard_size="300KB")
    assert diff <= 1e-5
    assert "AutoTokenizer cannot load it" in capsys.readouterr().out
    assert len(list((tmp_path / "o").glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "o" / "model.safetensors.index.json").is_file()
    ids = torch.arange(3, 19)[None]
    torch.testing.assert_close(_logits(_load_folder(tmp_path / "o"), ids), _logits(model, ids), atol=1e-5, rtol=0)
    tokenizer = CharTokenizer.from_pretrained(tmp_path / "o")
    assert tokenizer.alphabet == cfg.model.alphabet and tokenizer("ab")["input_ids"] == [3, 4]

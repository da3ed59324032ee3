"""data=text_dataset: a user's SFT files in TRL's formats, tokenized into cached Arrow, with the loss where it belongs,
overlong rows reported, packing that leaves the loss unchanged, and one clear line for each bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _user_assets import (
    message_rows,
    prompt_completion_rows,
    save_tiny_checkpoint,
    text_rows,
    write_jsonl,
    write_parquet,
)
from lit_memopt.data.text_dataset import IGNORE, TextDatasetDataModule, detect_format, pack_rows

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer(user_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(user_checkpoint)


def _module(tokenizer, tmp_path, rows=None, **kwargs) -> TextDatasetDataModule:
    if "path" not in kwargs:
        kwargs["path"] = str(write_jsonl(tmp_path / "data.jsonl", rows))
    kwargs.setdefault("cache_dir", str(tmp_path / "cache"))
    dm = TextDatasetDataModule(tokenizer, **kwargs)
    dm.setup("fit")
    return dm


def _learned_text(tokenizer, row) -> str:
    return tokenizer.decode([i for i, label in zip(row["input_ids"], row["labels"]) if label != IGNORE])


def test_formats_are_detected_from_the_columns() -> None:
    assert detect_format(["text", "id"]) == "text"
    assert detect_format(["messages"]) == "messages"
    assert detect_format(["conversations", "source"]) == "messages"
    assert detect_format(["prompt", "completion"]) == "prompt_completion"
    with pytest.raises(ValueError, match=r"the columns \['body', 'id'\] fit no dataset format.*`messages`"
                                         r".*`prompt` and `completion`.*`text`"):
        detect_format(["body", "id"])


def test_text_rows_are_learned_whole_and_end_with_eos(tokenizer, tmp_path) -> None:
    dm = _module(tokenizer, tmp_path, text_rows(8))
    row = dm.train_set[0]
    assert row["labels"] == row["input_ids"] and row["input_ids"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(row["input_ids"][:-1]) == text_rows(8)[0]["text"]


def test_messages_learn_the_assistant_turns_only(tokenizer, tmp_path) -> None:
    rows = message_rows(4)
    rows[0]["messages"] += [{"role": "user", "content": "Copy bb."}, {"role": "assistant", "content": "bb"}]
    dm = _module(tokenizer, tmp_path, rows)
    first = dm.train_set[0]
    answer = rows[0]["messages"][1]["content"]
    assert _learned_text(tokenizer, first) == f"{answer}<|im_end|>\nbb<|im_end|>\n"
    assert tokenizer.decode(first["input_ids"]) == tokenizer.apply_chat_template(rows[0]["messages"], tokenize=False)
    everything = _module(tokenizer, tmp_path / "all", rows, loss_on="all").train_set[0]
    assert everything["labels"][0] == everything["input_ids"][0] and IGNORE not in everything["labels"]


def test_sharegpt_conversations_are_mapped(tokenizer, tmp_path) -> None:
    rows = [{"conversations": [{"from": "human", "value": "Copy ab."}, {"from": "gpt", "value": "ab"}]}] * 3
    dm = _module(tokenizer, tmp_path, rows)
    assert dm.format == "messages" and _learned_text(tokenizer, dm.train_set[0]) == "ab<|im_end|>\n"


def test_prompt_completion_learns_the_completion(tokenizer, tmp_path) -> None:
    rows = prompt_completion_rows(4)
    dm = _module(tokenizer, tmp_path, rows)
    assert _learned_text(tokenizer, dm.train_set[0]) == rows[0]["completion"] + "<|im_end|>"
    chats = [{"prompt": [{"role": "user", "content": "Copy ab."}], "completion": [{"role": "assistant", "content": "ab"}]}] * 2
    assert _learned_text(tokenizer, _module(tokenizer, tmp_path / "c", chats).train_set[0]) == "ab<|im_end|>\n"


def test_overlong_rows_are_counted_then_cut_or_dropped(tokenizer, tmp_path) -> None:
    rows = text_rows(20)
    lengths = [len(tokenizer(r["text"], add_special_tokens=False)["input_ids"]) + 1 for r in rows]
    limit = sorted(lengths)[10]
    longer = sum(n > limit for n in lengths)
    cut = _module(tokenizer, tmp_path, rows, max_length=limit)
    assert cut.report["train"] == {"rows": 20, "overlong": longer, "nothing_to_learn": 0, "kept": 20}
    batch = next(iter(cut.val_dataloader() or cut._loader(cut.train_set, shuffle=False)))
    assert batch["input_ids"].shape[1] <= limit
    dropped = _module(tokenizer, tmp_path / "drop", rows, max_length=limit, overlong="drop")
    assert dropped.report["train"]["kept"] == 20 - longer
    assert max(len(r["input_ids"]) for r in dropped.train_set) <= limit


def test_eval_fraction_split_rename_parquet_and_save_to_disk(tokenizer, tmp_path) -> None:
    import datasets

    rows = [{"body": r["text"]} for r in text_rows(40)]
    parquet = write_parquet(tmp_path / "d.parquet", rows)
    dm = _module(tokenizer, tmp_path, path=str(parquet), columns={"body": "text"}, eval_fraction=0.25)
    assert (len(dm.train_set), len(dm.val_set)) == (30, 10)
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(text_rows(12)),
                          "test": datasets.Dataset.from_list(text_rows(4, seed=1))}).save_to_disk(saved)
    before = sorted(p.name for p in saved.rglob("*"))
    dm = _module(tokenizer, tmp_path, path=str(saved), eval_split="test")
    assert (len(dm.train_set), len(dm.val_set)) == (12, 4)
    assert sorted(p.name for p in saved.rglob("*")) == before  # no cache files written into the user's folder


def test_tokenized_tables_are_cached_and_reused(tokenizer, tmp_path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", text_rows(30))
    first = _module(tokenizer, tmp_path, path=str(path))
    cached = {f["filename"] for f in first.train_set.cache_files}
    assert cached and all(str(tmp_path / "cache" / "lit_memopt") in f for f in cached)
    again = _module(tokenizer, tmp_path, path=str(path))
    assert {f["filename"] for f in again.train_set.cache_files} == cached
    write_jsonl(path, text_rows(31))  # the file changed: prepared again
    assert len(_module(tokenizer, tmp_path, path=str(path)).train_set) == 31


def test_packing_keeps_rows_apart_and_the_loss_unchanged(user_checkpoint, tokenizer, tmp_path) -> None:
    """float64: the packed batch's per-token loss equals the unpacked batch's, tokens and all."""
    from transformers import AutoModelForCausalLM

    from lit_memopt.modules.sft import next_token_nll

    rows = prompt_completion_rows(10)
    plain = _module(tokenizer, tmp_path, rows, max_length=48)
    packed = _module(tokenizer, tmp_path / "p", rows, max_length=48, packing=True)
    assert len(packed.train_set) < len(plain.train_set)  # rows were really packed together
    assert all(min(r["position_ids"]) == 0 and r["position_ids"].count(0) >= 1 for r in packed.train_set)
    model = AutoModelForCausalLM.from_pretrained(user_checkpoint, dtype=torch.float64, attn_implementation="sdpa")
    unpacked_batch = plain._loader(plain.train_set, shuffle=False).collate_fn(list(plain.train_set))
    packed_batch = packed._loader(packed.train_set, shuffle=False).collate_fn(list(packed.train_set))
    assert "attention_mask" not in packed_batch
    loss_unpacked, count_unpacked = next_token_nll(model, unpacked_batch)
    loss_packed, count_packed = next_token_nll(model, packed_batch)
    assert int(count_packed) == int(count_unpacked) > 0
    torch.testing.assert_close(loss_packed, loss_unpacked, rtol=0, atol=1e-12)


def test_pack_rows_drops_each_rows_first_label() -> None:
    blocks = pack_rows([[1, 2, 3], [4, 5], [6, 7, 8, 9]], [[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_length=5)
    assert blocks["input_ids"] == [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert blocks["labels"] == [[IGNORE, 2, 3, IGNORE, 5], [IGNORE, 7, 8, 9]]
    assert blocks["position_ids"] == [[0, 1, 2, 0, 1], [0, 1, 2, 3]]


@pytest.mark.parametrize("form", ["text", "messages", "prompt_completion"])
def test_sft_loss_falls_on_each_format(user_checkpoint, tmp_path, form: str) -> None:
    import lightning.pytorch as pl

    from lit_memopt.models import ModelConfig
    from lit_memopt.modules.sft import SFTModule

    rows = {"text": text_rows, "messages": message_rows, "prompt_completion": prompt_completion_rows}[form](64)
    config = ModelConfig(name="user", pretrained=str(user_checkpoint))
    tokenizer = config.build_tokenizer()
    dm = TextDatasetDataModule(tokenizer, path=str(write_jsonl(tmp_path / "d.jsonl", rows)), max_length=64,
                               batch_size=16, cache_dir=str(tmp_path / "cache"))
    module = SFTModule(config, tokenizer, lr=3e-3, warmup_steps=2)
    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = pl.Trainer(max_steps=24, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()])
    trainer.fit(module, datamodule=dm)
    head, tail = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert tail < 0.7 * head, (form, losses)


def _fit_cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "lit_memopt", "fit", "recipe=sft", "data=text_dataset", "trainer.max_steps=1",
            f"hydra.run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", *overrides]
    return subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=240)


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("lit-memopt: error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_bad_data_is_one_line_before_training(user_checkpoint, tmp_path) -> None:
    """A missing file, columns of no format, an empty split, chats without a chat template: one line each."""
    model = f"model.pretrained={user_checkpoint}"
    line = _one_error_line(_fit_cli(tmp_path, model, f"data.path={tmp_path / 'missing.jsonl'}"))
    assert "missing.jsonl" in line and "never downloads" in line
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"body": "x", "id": 1}])
    line = _one_error_line(_fit_cli(tmp_path, model, f"data.path={odd}"))
    assert "['body', 'id'] fit no dataset format" in line and "data.columns" in line
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = _one_error_line(_fit_cli(tmp_path, model, "data.path=json", f"data.data_files={empty}"))
    assert "no rows" in line or "empty" in line.lower(), line
    no_template = save_tiny_checkpoint(tmp_path / "plain-ckpt", chat_template=False)
    chats = write_jsonl(tmp_path / "chats.jsonl", message_rows(4))
    line = _one_error_line(_fit_cli(tmp_path, f"model.pretrained={no_template}", f"data.path={chats}"))
    assert "no chat template" in line and "model.tokenizer" in line
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained

"""What a user brings, made by the tests themselves (no hub, no downloads): a tiny Qwen3 checkpoint saved with
``save_pretrained``, a BPE tokenizer trained with the ``tokenizers`` package and saved with a ChatML chat template,
and jsonl / parquet data files in the formats TRL reads.

The tasks are tiny and learnable (arithmetic facts and copies), so a few dozen steps visibly lower a loss.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def problems(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``(question, answer)`` pairs: small sums and word copies."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        if rng.random() < 0.5:
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            pairs.append((f"What is {a}+{b}?", str(a + b)))
        else:
            word = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 4)))
            pairs.append((f"Copy {word}.", word))
    return pairs


def train_tokenizer(directory: Path, *, chat_template: bool = True, vocab_size: int = 200) -> Any:
    """A byte-level BPE tokenizer trained on the tasks' texts, saved to ``directory`` (``AutoTokenizer`` loads it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"{q} {a}" for q, a in problems(500, seed=99)] + ["user assistant system Answer: The answer is"] * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    return tokenizer


def save_tiny_checkpoint(directory: Path, *, chat_template: bool = True, seed: int = 0) -> Path:
    """A tiny random-init Qwen3 and its tokenizer in one folder, as a user's local checkpoint looks."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = train_tokenizer(directory, chat_template=chat_template)
    config = AutoConfig.for_model(
        "qwen3", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def text_rows(count: int, seed: int = 0) -> list[dict[str, str]]:
    return [{"text": f"{q} {a}"} for q, a in problems(count, seed)]


def message_rows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in problems(count, seed)]


def prompt_completion_rows(count: int, seed: int = 0) -> list[dict[str, str]]:
    return [{"prompt": f"{q} ", "completion": a} for q, a in problems(count, seed)]


def prompt_answer_rows(count: int, seed: int = 0) -> list[dict[str, str]]:
    return [{"prompt": q, "answer": a} for q, a in problems(count, seed)]


def make_demo(folder: Path) -> None:
    """What the README's "Your model, your data" commands run on: a checkpoint and two data files in ``folder``."""
    save_tiny_checkpoint(folder / "tiny-qwen3")
    write_jsonl(folder / "chats.jsonl", message_rows(512))
    write_jsonl(folder / "math.jsonl", prompt_answer_rows(256))
    print(f"wrote {folder / 'tiny-qwen3'} (a tiny Qwen3 with a BPE tokenizer and a chat template), "
          f"{folder / 'chats.jsonl'} (512 chats) and {folder / 'math.jsonl'} (256 prompts with answers)")


if __name__ == "__main__":  # python tests/_user_assets.py DIR
    import sys

    make_demo(Path(sys.argv[1] if len(sys.argv) > 1 else "demo"))

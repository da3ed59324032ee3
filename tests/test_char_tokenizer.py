"""The character tokenizer (``model.alphabet``): ids, round trips, the model's vocabulary sized to it, and the
errors for a bad alphabet or a task character outside it."""

from __future__ import annotations

import random

import pytest

from lit_memopt.data.reasoning_prompts import ReasoningPromptsDataModule, restatement
from lit_memopt.models import CharTokenizer, ModelConfig

ALPHABET = "abcdefghijoprsvy =|"  # the intuitor recipe's: copy/reverse prompts over a-j and the restatement bar


def _arch(**extra):
    return {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, **extra}


def test_ids_are_the_specials_then_one_per_character_and_text_round_trips():
    tok = CharTokenizer("ab =")
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, len(tok)) == (0, 1, 2, 7)
    ids = tok(["ab =", "ba"], add_special_tokens=False)["input_ids"]
    assert ids == [[3, 4, 5, 6], [4, 3]]
    assert tok("ab")["input_ids"] == [3, 4]  # like the byte tokenizer's callers, no special token is added
    assert tok.decode([3, 5, 4, tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == "a b"
    assert tok("az", add_special_tokens=False)["input_ids"] == [3, tok.unk_token_id]


def test_model_vocabulary_is_sized_to_the_alphabet():
    config = ModelConfig(name="t", arch=_arch(), alphabet=ALPHABET)
    tok, model = config.build_tokenizer(), config.build_model()
    assert model.config.vocab_size == len(tok) == len(ALPHABET) + 3
    assert model.get_output_embeddings().weight.shape[0] == len(tok)
    assert (model.config.pad_token_id, model.config.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)


@pytest.mark.parametrize("alphabet, message", [("", "non-empty"), ("abca", r"\['a'\] more than once"), (3, "non-empty")])
def test_a_bad_alphabet_is_named(alphabet, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(name="t", arch=_arch(), alphabet=alphabet)


def test_an_alphabet_and_a_different_vocabulary_size_are_named():
    assert ModelConfig(name="t", arch=_arch(vocab_size=5), alphabet="ab").arch["vocab_size"] == 5
    with pytest.raises(ValueError, match=r"needs arch \{'vocab_size': 5\}, got \{'vocab_size': 384\}"):
        ModelConfig(name="t", arch=_arch(vocab_size=384), alphabet="ab")


def test_an_alphabet_cannot_replace_a_tokenizer_directory(tmp_path):
    with pytest.raises(ValueError, match="cannot be combined with model.tokenizer"):
        ModelConfig(name="t", arch=_arch(), alphabet="ab", tokenizer=str(tmp_path))


def test_a_checkpoint_replaces_the_toy_alphabet(user_checkpoint):
    """Any model= group works with model.pretrained: the checkpoint's own vocabulary and tokenizer win."""
    config = ModelConfig(name="t", arch=_arch(), alphabet="ab", pretrained=str(user_checkpoint))
    assert config.alphabet is None and config.is_checkpoint
    tokenizer = config.build_tokenizer()
    assert type(tokenizer).__name__ != "CharTokenizer" and tokenizer.chat_template
    assert config.build_model().get_input_embeddings().weight.shape[0] == len(tokenizer)


def test_task_characters_outside_the_alphabet_are_named_before_training():
    data = ReasoningPromptsDataModule(CharTokenizer("abcdefghij =|"), task="strings", num_val=8)
    with pytest.raises(ValueError, match=r"cannot encode \['o', 'p', 'r', 's', 'v', 'y'\].*model.alphabet"):
        data.setup()
    ReasoningPromptsDataModule(CharTokenizer(ALPHABET), task="strings", num_val=8, restate_input=True).setup()
    without_bar = ALPHABET.replace("|", "")
    with pytest.raises(ValueError, match=r"cannot encode \['\|'\]"):
        ReasoningPromptsDataModule(CharTokenizer(without_bar), task="strings", num_val=8, restate_input=True).setup()


def test_restated_responses_restate_the_input_and_mix_it_with_a_guess():
    tok = CharTokenizer(ALPHABET)
    data = ReasoningPromptsDataModule(tok, task="strings", min_word_length=5, num_val=16, restate_input=True,
                                      warm_start_guess_rate=0.5)
    guessed = mixed = 0
    for prompt, response in data.warm_start_examples(400, seed=3):
        task, word = prompt.rstrip("=").split(" ")
        answer, restated = response.split("|")
        truth = word if task == "copy" else word[::-1]
        assert data.checker(response, truth) == float(answer == truth)  # the checker scores the answer alone
        if answer == truth:
            assert restated == word
            continue
        guessed += 1
        implied = answer if task == "copy" else answer[::-1]
        assert all(r in (w, i) for r, w, i in zip(restated, word, implied)) and len(restated) == len(word)
        mixed += restated not in (word, implied)
    assert 150 < guessed < 250 and mixed > guessed // 2  # half of the answers guessed; most restatements mix
    rng = random.Random(0)
    assert restatement(rng, "reverse abcde") == "abcde"
    draws = {restatement(rng, "copy aaaaa", "bbbbb") for _ in range(50)}
    assert len(draws) > 10 and all(set(d) <= {"a", "b"} for d in draws)  # each letter from one or the other


def test_restating_needs_string_tasks():
    with pytest.raises(ValueError, match="data.restate_input .* includes \\['add', 'max', 'mul', 'sub'\\]"):
        ReasoningPromptsDataModule(CharTokenizer(ALPHABET), task="mixed", restate_input=True)

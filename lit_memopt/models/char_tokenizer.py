"""A character tokenizer over a given alphabet: a vocabulary the size of a synthetic task, with no files.

The byte-level default has 384 ids, and a synthetic task uses a dozen of them. Scores that average over the
whole vocabulary, such as Intuitor's self-certainty ``KL(U || p)``, are then decided by how far down the
never-used ids sit, not by the model's choice among the characters it writes. A model whose vocabulary is its
task's alphabet has no such tail (``ModelConfig(alphabet=...)``, ``model.alphabet`` in a recipe).
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizer

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2: the byte-level tokenizer's pad and eos ids too


def check_alphabet(alphabet: object) -> str:
    """``alphabet`` as a string of distinct characters, or a ``ValueError`` that says what is wrong."""
    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError(f"model.alphabet must be a non-empty string of characters, got {alphabet!r}.")
    repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
    if repeated:
        raise ValueError(f"model.alphabet lists {repeated} more than once; give each character once.")
    return alphabet


class CharTokenizer(PreTrainedTokenizer):
    """One id per character of ``alphabet``, after ``<pad>`` (0), ``</s>`` (1) and ``<unk>`` (2).

    A character outside the alphabet encodes as ``<unk>``; :func:`unknown_characters` finds them before any
    training. Like the byte-level tokenizer, ``add_special_tokens`` adds nothing: callers append the
    end-of-sequence id themselves.

    Example::

        tok = CharTokenizer("abc=")
        tok("ab=", add_special_tokens=False)["input_ids"]  # [3, 4, 6]
        tok.decode([3, 4, 1], skip_special_tokens=True)    # "ab"
    """

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, alphabet: str, **kwargs: Any) -> None:
        self.alphabet = check_alphabet(alphabet)
        self._ids = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *alphabet))}
        self._tokens = {i: token for token, i in self._ids.items()}
        kwargs = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>", **kwargs}
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._ids)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._ids)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return list(text)

    def _convert_token_to_id(self, token: str) -> int:
        return self._ids.get(token, self._ids["<unk>"])

    def _convert_id_to_token(self, index: int) -> str:
        return self._tokens.get(int(index), "<unk>")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        return ()  # the alphabet is the whole vocabulary; it lives in the model config


def unknown_characters(tokenizer: Any, texts: list[str]) -> list[str]:
    """The characters of ``texts`` that ``tokenizer`` cannot encode (a :class:`CharTokenizer` outside its
    alphabet); empty for any other tokenizer."""
    if not isinstance(tokenizer, CharTokenizer):
        return []
    known = set(tokenizer.alphabet)
    return sorted({c for text in texts for c in text if c not in known})

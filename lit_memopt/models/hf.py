"""Build transformers causal LMs from architecture configs or local checkpoints, offline."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning_utilities.core.imports import RequirementCache

# transformers 4.56 renamed the `torch_dtype` argument of from_pretrained/from_config to `dtype` (the old name only
# warns from then on); the releases before it, which pyproject.toml still admits, know only `torch_dtype`.
TRANSFORMERS_DTYPE_ARG = "dtype" if RequirementCache("transformers>=4.56") else "torch_dtype"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def plain_container(value: Any) -> Any:
    """Hydra hands over ``DictConfig``/``ListConfig``; transformers and peft want plain containers."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - hydra is a dependency
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a config string (``float32``, ``bfloat16``, ``float16``) to a ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}.")
    return _DTYPES[dtype]


def require_local_path(path: str, key: str) -> str:
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{key}={path!r} does not exist. Give a local directory holding the files "
            f"(this pack never downloads from a hub), or set {key}=null for the built-in default."
        )
    return path


def build_tokenizer(path: str | None = None):
    """The byte-level ByT5 tokenizer (no files needed) or, with ``path``, a local tokenizer."""
    from transformers import AutoTokenizer, ByT5Tokenizer

    if path is None:
        return ByT5Tokenizer()
    return AutoTokenizer.from_pretrained(require_local_path(path, "model.tokenizer"))


def pretrained_tokenizer(path: str):
    """The tokenizer saved in a checkpoint folder, or one line saying that the folder has none and what to do."""
    from transformers import AutoTokenizer

    path = require_local_path(path, "model.pretrained")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"model.pretrained={path!r} holds no tokenizer that AutoTokenizer can load "
                         f"({str(err).splitlines()[0][:160]}); set model.tokenizer=/path/to/its/tokenizer.") from None


def enable_gradient_checkpointing(model: torch.nn.Module, every_n_layers: int = 1) -> None:
    """Non-reentrant activation checkpointing of every ``every_n_layers``-th decoder layer of a transformers model
    (the 1st, the (n+1)-th, ...; ``1``: every layer).

    transformers 5.x renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable`` (the old
    name warns that it goes in v6) and added ``every_n_layers``; older releases have only the old name, and
    checkpoint every layer.

    Raises:
        ValueError: ``every_n_layers`` below 1, or above 1 with a transformers release that has no such option.
    """
    if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
        raise ValueError(f"every_n_layers must be a positive integer (1: every layer), got {every_n_layers!r}")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
    elif every_n_layers == 1:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(f"checkpointing every {every_n_layers}th layer needs transformers >= 5 "
                         "(activation_checkpointing_enable(every_n_layers=...)); use gradient_checkpointing=true")


def checkpoint_period(value: Any, name: str = "gradient_checkpointing") -> int:
    """A module's ``gradient_checkpointing`` setting as a period: 0 (off), 1 (every decoder layer) or k (every k-th).

    Accepts ``false``/``true`` and non-negative integers.

    Raises:
        ValueError: anything else, naming the setting.
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value >= 0:
        return value
    raise ValueError(f"{name} must be true, false or k >= 2 (every k-th decoder layer), got {value!r}")


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The ``[V, H]`` output-embedding weight of a transformers causal LM (LoRA-wrapped or not)."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embedding with a weight; cannot use the fused head ops.")
    return head.weight


@dataclass
class ModelConfig:
    """What to build: an architecture (a transformers config as a dict) or a local checkpoint.

    Instantiating it is cheap (no weights); ``build_model`` creates the network.

    Args:
        name: short name used in logs and run directories.
        arch: keyword arguments of the transformers config, including ``model_type``
            (``qwen3``, ``qwen2``, ``llama``, ...). Ignored for the weights when ``pretrained`` is set.
        pretrained: local directory for ``from_pretrained``; ``None`` builds from ``arch`` with random init.
        tokenizer: local tokenizer directory; ``None`` uses ``pretrained``'s tokenizer when a checkpoint is given,
            else the byte-level tokenizer.
        alphabet: build a character tokenizer over these characters instead
            (:class:`lit_memopt.models.char_tokenizer.CharTokenizer`: ``<pad>``, ``</s>``, ``<unk>``, then one id
            per character) and size the model's vocabulary to it (``arch.vocab_size`` 3 + characters, pad id 0,
            eos id 1; filled in when left out). For synthetic tasks whose scores average over the vocabulary;
            not with ``tokenizer``, and dropped when ``pretrained`` is given (the checkpoint has its own vocabulary).
        dtype: parameter dtype, ``float32`` or ``bfloat16`` (``float16`` also accepted).
        lora: ``None`` for full fine-tuning, or a dict with ``r``, ``alpha``, ``dropout``, ``target_modules``.
        attn_implementation: transformers attention backend (``sdpa`` by default, ``eager`` for debugging).
    """

    name: str = "model"
    arch: dict[str, Any] = field(default_factory=dict)
    pretrained: str | None = None
    tokenizer: str | None = None
    dtype: str = "float32"
    alphabet: str | None = None
    lora: dict[str, Any] | None = None
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        self.arch = dict(plain_container(self.arch) or {})
        self.lora = dict(plain_container(self.lora)) if self.lora else None
        resolve_dtype(self.dtype)
        if self.pretrained is None and "model_type" not in self.arch:
            raise ValueError(
                f"model {self.name!r}: set model.arch.model_type (e.g. qwen3) or model.pretrained=/local/path."
            )
        if self.alphabet is not None and self.pretrained is not None:
            # A checkpoint brings its own vocabulary and tokenizer: any model= group works with model.pretrained=DIR,
            # including the toy groups whose character alphabet sizes a random-init model.
            self.alphabet = None
        if self.alphabet is not None:
            from lit_memopt.models.char_tokenizer import SPECIAL_TOKENS, check_alphabet

            if self.tokenizer is not None:
                raise ValueError(f"model {self.name!r}: model.alphabet builds its own tokenizer and vocabulary; it "
                                 "cannot be combined with model.tokenizer (set one of them to null).")
            # the embedding has exactly one row per id: no never-used ids (see char_tokenizer.py for why)
            ids = {"vocab_size": len(SPECIAL_TOKENS) + len(check_alphabet(self.alphabet)),
                   "pad_token_id": SPECIAL_TOKENS.index("<pad>"), "eos_token_id": SPECIAL_TOKENS.index("</s>")}
            clashes = {k: self.arch[k] for k, v in ids.items() if self.arch.get(k, v) != v}
            if clashes:
                raise ValueError(f"model {self.name!r}: model.alphabet {self.alphabet!r} needs arch "
                                 f"{ {k: ids[k] for k in clashes} }, got {clashes}; set those (or leave them out).")
            self.arch.update(ids)
        if self.lora is not None:
            unknown = set(self.lora) - {"r", "alpha", "dropout", "target_modules"}
            if unknown:
                raise ValueError(f"model.lora has unknown keys {sorted(unknown)}; use r, alpha, dropout, target_modules.")
            if int(self.lora.get("r", 0)) <= 0:
                raise ValueError(f"model.lora.r must be a positive integer, got {self.lora.get('r')!r}.")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    def hf_config(self):
        """The transformers config, from ``pretrained`` when given, else from ``arch``."""
        from transformers import AutoConfig

        if self.pretrained is not None:
            return AutoConfig.from_pretrained(require_local_path(self.pretrained, "model.pretrained"))
        arch = dict(self.arch)
        model_type = arch.pop("model_type")
        return AutoConfig.for_model(model_type, **arch)

    def load_kwargs(self) -> dict[str, Any]:
        """The dtype and attention keywords of transformers' ``from_pretrained`` / ``from_config``, by its version."""
        return {TRANSFORMERS_DTYPE_ARG: self.torch_dtype, "attn_implementation": self.attn_implementation}

    def build_model(self, *, apply_lora: bool = True) -> torch.nn.Module:
        """A causal LM with weights (random from ``arch``, or loaded from ``pretrained``), LoRA applied if set."""
        from transformers import AutoModelForCausalLM

        kwargs = self.load_kwargs()
        if self.pretrained is not None:
            model = AutoModelForCausalLM.from_pretrained(require_local_path(self.pretrained, "model.pretrained"), **kwargs)
            model.train()  # from_pretrained returns eval mode; a built policy trains (dropout as its config says)
        else:
            model = AutoModelForCausalLM.from_config(self.hf_config(), **kwargs)
        if self.lora is not None and apply_lora:
            model = self.apply_lora(model)
        return model

    def apply_lora(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap ``model`` with peft LoRA adapters; only adapter weights stay trainable."""
        from peft import LoraConfig, get_peft_model

        assert self.lora is not None
        config = LoraConfig(
            r=int(self.lora.get("r", 16)),
            lora_alpha=int(self.lora.get("alpha", 32)),
            lora_dropout=float(self.lora.get("dropout", 0.0)),
            target_modules=list(self.lora.get("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj"])),
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, config)

    def build_tokenizer(self):
        if self.alphabet is not None:
            from lit_memopt.models.char_tokenizer import CharTokenizer

            return CharTokenizer(self.alphabet)
        if self.tokenizer is None and self.pretrained is not None:
            return pretrained_tokenizer(self.pretrained)
        return build_tokenizer(self.tokenizer)

    @property
    def is_checkpoint(self) -> bool:
        """Weights come from a user's checkpoint (``pretrained``), not a random init: warm starts are skipped."""
        return self.pretrained is not None


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformer body (embeddings + layers + final norm) of a causal LM, peft-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    if decoder is None:
        raise ValueError(f"cannot find the decoder of {type(base).__name__}; expected a transformers *ForCausalLM model.")
    return decoder


def decoder_outputs(model: torch.nn.Module, **kwargs: Any) -> Any:
    """The decoder's output (``last_hidden_state``, ``past_key_values``) of a causal LM, without its LM head.

    When the model is FSDP2-sharded (``fully_shard`` on its root), the decoder cannot be called on its
    own: the root's parameters (embeddings, final norm, LM head) are gathered only by the root's
    forward. The root then runs with no logits to keep (an empty ``logits_to_keep``, a ``[B, 0, V]``
    head product) and the decoder's output is taken from a forward hook. The root's parameters stay
    gathered until its backward, so ``lm_head_weight(model)`` is the full weight for the head ops.
    """
    from lit_memopt.models.sharding import is_fsdp_sharded

    decoder = decoder_of(model)
    if not is_fsdp_sharded(model):
        return decoder(**kwargs)
    captured: list[Any] = []
    handle = decoder.register_forward_hook(lambda _module, _args, output: captured.append(output))
    try:
        reference = kwargs.get("input_ids")
        if reference is None:
            reference = kwargs["inputs_embeds"]
        model(**kwargs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=reference.device))
    finally:
        handle.remove()
    return captured[-1]


def decoder_hidden_states(model: torch.nn.Module, input_ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """Final hidden states ``[B, T, H]`` of a causal LM, without running its LM head.

    Feed them with ``lm_head_weight(model)`` to the ``lit_memopt.ops`` head ops; the ``[B, T, V]``
    logits are never built. Keyword arguments (``attention_mask``, ``inputs_embeds``,
    ``position_ids``, ``past_key_values``, ``use_cache``) go to the decoder. Works for FSDP2-sharded
    models too (see :func:`decoder_outputs`).
    """
    kwargs.setdefault("use_cache", False)
    return decoder_outputs(model, input_ids=input_ids, **kwargs).last_hidden_state

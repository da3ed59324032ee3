"""``lit-memopt export``: a finished run's model as a Hugging Face folder that any ``from_pretrained`` loads.

The model is rebuilt from the run's own config (Hydra's ``<run_dir>/.hydra/config.yaml``, found from the
checkpoint's location) and only its weights are read from the checkpoint: a single-file ``.ckpt`` (memory-mapped)
or the sharded directory that ``trainer=fsdp2`` writes (torch.distributed.checkpoint, read on CPU with no process
group and without the optimizer state). LoRA is merged unless ``lora=adapter`` asks for a PEFT adapter folder.
The folder holds safetensors shards, ``config.json``, the generation config and the tokenizer with its chat
template; the export ends by loading what it wrote and printing its largest logit difference from the trained model.

``fit ... export=DIR`` runs the same export when training ends (see :func:`export_after_fit`).
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from lit_memopt.models.adapters import add_named_adapters, is_peft_model
from lit_memopt.models.sharding import is_fsdp_sharded

USAGE = ("lit-memopt export ckpt_path=RUN/checkpoints/last.ckpt out=DIR [lora=merge|adapter] [adapter=NAME] "
         "[overwrite=true] [config=RUN/.hydra/config.yaml] [max_shard_size=5GB]")
LORA_MODES = ("merge", "adapter")
OPTIONS = ("ckpt_path", "out", "lora", "adapter", "overwrite", "config", "max_shard_size")
# Where the pack's LightningModules keep the network they train: ``self.model`` (GRADE: ``self.policy``). Other
# top-level attributes (a frozen ``reference`` copy, reward models, normalizers) are not part of the export.
MODEL_ATTRIBUTES = ("model", "policy")
# What an export writes: on overwrite=true only these are replaced, so a user's own files in the folder survive.
EXPORT_FILES = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                "adapter_config.json", "adapter_model.*", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
                "chat_template.*", "vocab.*", "merges.txt", "*.model", "pytorch_model*.bin")
PROBE_TOKENS = 16  # tokens of the reload check: enough to exercise attention, cheap for any model size


class ExportError(ValueError):
    """A user mistake (bad option, missing file, wrong kind of model): the CLI prints it as one line, exit code 2."""


@dataclass
class ExportOptions:
    ckpt_path: Path
    out: Path
    lora: str = "merge"
    adapter: str | None = None
    overwrite: bool = False
    config: Path | None = None
    max_shard_size: str = "5GB"


# ----------------------------------------------------------------------------- options
def parse_options(args: Sequence[str]) -> ExportOptions:
    """``key=value`` arguments of ``lit-memopt export`` (not Hydra: the run's config is read, not composed)."""
    values: dict[str, str] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ExportError(f"export takes key=value options, got {arg!r}; usage: {USAGE}")
        if key not in OPTIONS:
            match = difflib.get_close_matches(key, OPTIONS, n=1)
            hint = f" (did you mean {match[0]!r}?)" if match else ""
            raise ExportError(f"unknown export option {key!r}{hint}; options: {', '.join(OPTIONS)}")
        values[key] = value
    for required, example in (("ckpt_path", "RUN/checkpoints/last.ckpt"), ("out", "DIR")):
        if not values.get(required):
            raise ExportError(f"export needs {required}={example}; usage: {USAGE}")
    lora = values.get("lora", "merge")
    if lora not in LORA_MODES:
        raise ExportError(f"unknown lora={lora!r}; choose one of: {', '.join(LORA_MODES)}")
    overwrite = values.get("overwrite", "false").lower()
    if overwrite not in ("true", "false"):
        raise ExportError(f"overwrite must be true or false, got {values['overwrite']!r}")
    return ExportOptions(
        ckpt_path=Path(values["ckpt_path"]).expanduser(), out=Path(values["out"]).expanduser(), lora=lora,
        adapter=values.get("adapter") or None, overwrite=overwrite == "true",
        config=Path(values["config"]).expanduser() if values.get("config") else None,
        max_shard_size=values.get("max_shard_size", "5GB"),
    )


def find_run_config(ckpt_path: Path, config: Path | None = None) -> Path:
    """The run's Hydra config: ``config`` when given, else ``.hydra/config.yaml`` of the run holding the checkpoint
    (``<run_dir>/checkpoints/last.ckpt``, or a checkpoint directly in the run directory)."""
    if config is not None:
        if not config.is_file():
            raise ExportError(f"config={str(config)!r} is not a file; give the run's .hydra/config.yaml")
        return config
    # two levels up at most: a config further away would belong to some other run
    candidates = [parent / ".hydra" / "config.yaml" for parent in list(ckpt_path.resolve().parents)[:2]]
    found = next((c for c in candidates if c.is_file()), None)
    if found is not None:
        return found
    raise ExportError(f"no run config found for ckpt_path={str(ckpt_path)!r} (looked for .hydra/config.yaml in "
                      f"{', '.join(str(c.parent.parent) for c in candidates)}); add config=RUN_DIR/.hydra/config.yaml")


# ----------------------------------------------------------------------------- reading weights
def _choose_prefix(keys: Sequence[str]) -> str:
    for attr in MODEL_ATTRIBUTES:
        if any(key.startswith(attr + ".") for key in keys):
            return attr + "."
    tops = sorted({key.split(".", 1)[0] for key in keys})
    raise ExportError(f"the checkpoint holds no weights under {' or '.join(MODEL_ATTRIBUTES)} (its top-level names: "
                      f"{', '.join(tops) or 'none'}); export needs a module that keeps its transformers model as self.model")


def read_model_weights(ckpt_path: Path) -> dict[str, torch.Tensor]:
    """The trained network's weights from a Lightning checkpoint, with the LightningModule's prefix stripped."""
    if ckpt_path.is_dir():
        return _read_sharded(ckpt_path)
    try:
        # mmap: tensors are paged in as they are copied into the model, so the file is never held twice in memory
        checkpoint = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file is a user mistake, said in one line
        raise ExportError(f"cannot read ckpt_path={str(ckpt_path)!r}: {str(exc).strip().splitlines()[0][:200]}") from None
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ExportError(f"ckpt_path={str(ckpt_path)!r} has no 'state_dict': not a checkpoint written by Lightning")
    prefix = _choose_prefix(list(state))
    return {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}


def _read_sharded(path: Path) -> dict[str, torch.Tensor]:
    """The model entries of a torch.distributed.checkpoint directory, read on this process alone.

    Lightning's ModelParallelStrategy saves ``{"state_dict": <module state>, "optimizer_0": ...}`` flattened to
    keys such as ``state_dict.model.lm_head.weight``; only the model's tensors are allocated and read.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (path / ".metadata").is_file():
        raise ExportError(f"ckpt_path={str(path)!r} is a directory but not a sharded checkpoint (no .metadata); give a "
                          ".ckpt file or the last.ckpt directory of a trainer=fsdp2 run")
    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata().state_dict_metadata
    tensors = {key[len("state_dict."):]: meta for key, meta in metadata.items()
               if key.startswith("state_dict.") and isinstance(meta, TensorStorageMetadata)}
    prefix = _choose_prefix(list(tensors))
    state = {f"state_dict.{key}": torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in tensors.items() if key.startswith(prefix)}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": reading on one process is the intent
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key[len("state_dict.") + len(prefix):]: value for key, value in state.items()}


# ----------------------------------------------------------------------------- checks
def check_hf_model(model: nn.Module) -> None:
    """Export writes Hugging Face folders: the network must be a transformers model (peft-wrapped or not)."""
    from transformers import PreTrainedModel

    base = model.get_base_model() if is_peft_model(model) else model
    if not isinstance(base, PreTrainedModel):
        raise ExportError(f"export writes Hugging Face model folders, and this run's model is a {type(base).__name__}, "
                          "not a transformers PreTrainedModel (or a peft wrapper of one)")


def adapter_names(weights: Sequence[str]) -> list[str]:
    """LoRA adapter names in weight keys (``...lora_A.<name>.weight``), in first-seen order."""
    names = [part for key in weights for before, part in zip(key.split("."), key.split(".")[1:])
             if before in ("lora_A", "lora_B")]
    return list(dict.fromkeys(names))


def check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"out={str(out)!r} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"out={str(out)!r} is not empty; give an empty or new folder, or add overwrite=true to "
                          "replace the files an export writes there (other files are kept)")


def _is_export_file(path: Path) -> bool:
    return path.is_file() and any(fnmatch.fnmatch(path.name, pattern) for pattern in EXPORT_FILES)


def clear_earlier_export(out: Path) -> None:
    """Remove what an earlier export wrote to ``out`` (stale shards would mix with new ones); keep everything else."""
    removed = [p for p in out.iterdir() if _is_export_file(p)]
    # an earlier multi-adapter export keeps each adapter in a sub-folder of export files only
    removed += [p for p in out.iterdir() if p.is_dir() and (p / "adapter_config.json").is_file()
                and all(_is_export_file(f) or f.name == "README.md" for f in p.iterdir())]
    for path in removed:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    kept = sorted(p.name for p in out.iterdir())
    print(f"export: overwrite=true: removed {len(removed)} files of an earlier export from {out}"
          + (f"; kept {', '.join(kept)}" if kept else ""))


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor], *, base_changes: bool = False) -> list[str]:
    """Load ``weights``, which must name exactly the model's (a TTT branch or another module's net would not fit).

    With ``base_changes``, returns the non-LoRA weights that differ from the model as built (pretrained or random).
    """
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or unexpected:
        few = lambda keys: ", ".join(keys[:3]) + (" ..." if len(keys) > 3 else "")  # noqa: E731
        raise ExportError(f"the checkpoint's weights do not fit the model built from the run config (missing: "
                          f"{few(missing) or 'none'}; unexpected: {few(unexpected) or 'none'}); was it written by this run?")
    changed = [key for key, value in weights.items() if base_changes and "lora_" not in key
               and not torch.equal(own[key], value.to(own[key].dtype))]
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:  # shape mismatches: a config that is not the checkpoint's
        raise ExportError(f"the checkpoint's weights do not fit the model built from the run config: "
                          f"{str(exc).strip().splitlines()[-1][:200]}") from None
    return changed


# ----------------------------------------------------------------------------- export
@torch.no_grad()
def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float()


def export_model(model_cfg: Any, weights: dict[str, torch.Tensor], out: Path, *, lora: str = "merge",
                 adapter: str | None = None, overwrite: bool = False, max_shard_size: str = "5GB") -> float:
    """Rebuild the model of ``model_cfg`` (the run's ``model`` config section), load ``weights``, write ``out``.

    Returns the largest absolute float32 logit difference of the reloaded folder from the trained model.
    """
    from hydra.utils import instantiate

    check_out_dir(out, overwrite)
    # the options are checked against the checkpoint's weight names first: a mistake costs no model loading
    names = adapter_names(list(weights))
    if lora == "adapter" and not names:
        raise ExportError("lora=adapter: this run trained no LoRA adapters (model.lora is null); leave lora out")
    if adapter is not None and adapter not in names:
        raise ExportError(f"adapter={adapter!r} is not in the checkpoint; its adapters: {', '.join(names) or 'none'}")
    if lora == "merge" and len(names) > 1 and adapter is None:
        raise ExportError(f"the run has several LoRA adapters ({', '.join(names)}): merging needs adapter=NAME "
                          "(or lora=adapter to write them all)")
    model_config = instantiate(model_cfg)
    model = model_config.build_model()
    check_hf_model(model)
    tokenizer = model_config.build_tokenizer()
    if is_peft_model(model) and names and names != ["default"]:
        add_named_adapters(model, tuple(names), active=names[0])  # CRSP's role adapters: rebuilt as the module did
    changed = load_weights(model, weights, base_changes=lora == "adapter")
    if lora == "adapter" and (model_config.pretrained is None or changed):
        # An adapter folder is loaded onto model.pretrained: it only reproduces the run if the base is unchanged.
        why = (f"changed {len(changed)} base weights (e.g. {changed[0]}; a warm start trains the base)" if changed
               else "built its base at random (no model.pretrained), which no folder holds")
        raise ExportError(f"lora=adapter: the run {why}, so an adapter alone cannot reproduce it; use lora=merge")
    model.eval()

    # reference logits of the trained model, before merging changes it: one set per adapter written
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.linspace(0, vocab - 1, min(PROBE_TOKENS, vocab)).round().long()[None]
    if adapter is not None:
        chosen: list[Any] = [adapter]
    elif lora == "adapter":
        chosen = names  # every adapter of the run
    else:
        chosen = [names[0] if names else None]  # None: no LoRA, the full model
    reference = {}
    for name in chosen:
        if name is not None:
            model.set_adapter(name)
        reference[name] = _logits(model, ids)

    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        clear_earlier_export(out)
    _write_folder(model, tokenizer, out, lora=lora, chosen=chosen, max_shard_size=max_shard_size)
    reloaded = _reload(out, model_config, lora=lora, chosen=chosen)
    diff = 0.0
    for name, expected in reference.items():
        if name is not None and lora == "adapter":
            reloaded.set_adapter(name)
        diff = max(diff, (_logits(reloaded, ids) - expected).abs().max().item())
    what = f"LoRA adapter{'s' if len(chosen) > 1 else ''} {', '.join(chosen)}" if lora == "adapter" else (
        f"LoRA {chosen[0]} merged" if names else "full weights")
    print(f"export: wrote {out} ({what}); reloaded: largest |logit difference| from the trained model "
          f"{diff:.3g} (float32, {ids.shape[1]} tokens)")
    _check_tokenizer(tokenizer, out)
    return diff


def _write_folder(model: Any, tokenizer: Any, out: Path, *, lora: str, chosen: list[Any], max_shard_size: str) -> None:
    """Weights (merged, full, or the adapters), generation config and tokenizer into ``out``."""
    from lit_memopt.models.char_tokenizer import CharTokenizer

    if lora == "adapter":
        model.save_pretrained(str(out), selected_adapters=chosen)
        if chosen != ["default"] and len(chosen) == 1:  # peft puts a non-default adapter in a sub-folder: flatten it
            for path in (out / chosen[0]).iterdir():
                shutil.move(str(path), str(out / path.name))
            (out / chosen[0]).rmdir()
        written = model.get_base_model()
    else:
        written = model.merge_and_unload(adapter_names=[chosen[0]]) if is_peft_model(model) else model
        save = written.save_pretrained
        extra = {"safe_serialization": True} if "safe_serialization" in inspect.signature(save).parameters else {}
        save(str(out), max_shard_size=max_shard_size, **extra)  # transformers 5 writes safetensors only
    # generation config: the tokenizer decides where a generation ends and what pads a batch
    generation = written.generation_config
    for attr in ("eos_token_id", "pad_token_id"):
        if getattr(tokenizer, attr, None) is not None:
            setattr(generation, attr, getattr(tokenizer, attr))
    generation.save_pretrained(str(out))
    if isinstance(tokenizer, CharTokenizer):
        tokenizer.init_kwargs["alphabet"] = tokenizer.alphabet  # so CharTokenizer.from_pretrained(out) rebuilds it
    tokenizer.save_pretrained(str(out))


def _reload(out: Path, model_config: Any, *, lora: str, chosen: list[Any]) -> Any:
    """What was written, loaded the way a user will: ``from_pretrained``, or the base + ``PeftModel``."""
    from transformers import AutoModelForCausalLM

    kwargs = model_config.load_kwargs()
    if lora != "adapter":
        return AutoModelForCausalLM.from_pretrained(str(out), **kwargs).eval()
    from peft import PeftModel

    folder = {name: out if len(chosen) == 1 or name == "default" else out / name for name in chosen}  # peft's layout
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_config.pretrained, **kwargs),
                                         str(folder[chosen[0]]), adapter_name=chosen[0])
    for name in chosen[1:]:
        reloaded.load_adapter(str(folder[name]), adapter_name=name)
    return reloaded.eval()


def _check_tokenizer(tokenizer: Any, out: Path) -> None:
    from transformers import AutoTokenizer

    from lit_memopt.models.char_tokenizer import CharTokenizer

    if isinstance(tokenizer, CharTokenizer):
        print("export: the toy CharTokenizer is saved, but AutoTokenizer cannot load it: use "
              f"lit_memopt.models.CharTokenizer.from_pretrained({str(out)!r})")
    elif getattr(AutoTokenizer.from_pretrained(str(out)), "chat_template", None) != getattr(tokenizer, "chat_template", None):
        raise RuntimeError(f"the tokenizer reloaded from {out} lost its chat template")


def export_checkpoint(options: ExportOptions) -> float:
    """``lit-memopt export``: the run config found from the checkpoint, the weights read from it, the folder written."""
    from omegaconf import OmegaConf

    if not options.ckpt_path.exists():
        raise ExportError(f"ckpt_path={str(options.ckpt_path)!r} does not exist; give a run's checkpoints/last.ckpt")
    config_path = find_run_config(options.ckpt_path, options.config)
    check_out_dir(options.out, options.overwrite)  # before the slow part
    cfg = OmegaConf.load(config_path)
    if cfg.get("model") is None:
        raise ExportError(f"{config_path} has no 'model' section: not the config of a lit-memopt run")
    weights = read_model_weights(options.ckpt_path)
    return export_model(cfg.model, weights, options.out, lora=options.lora, adapter=options.adapter,
                        overwrite=options.overwrite, max_shard_size=options.max_shard_size)


def run_export_command(args: Sequence[str]) -> int:
    """Entry point of ``lit-memopt export``; :class:`ExportError` is the caller's to print."""
    if any(arg in ("-h", "--help", "help") for arg in args):
        print(f"usage: {USAGE}\n(see docs/export.md)")
        return 0
    export_checkpoint(parse_options(args))
    return 0


# ----------------------------------------------------------------------------- fit ... export=DIR
def trained_model(module: nn.Module) -> nn.Module:
    """The transformers model a LightningModule trains (``module.model``, or GRADE's ``module.policy``)."""
    for attr in MODEL_ATTRIBUTES:
        model = getattr(module, attr, None)
        if isinstance(model, nn.Module):
            check_hf_model(model)
            return model
    raise ExportError(f"export needs a module that keeps its transformers model as self.model; "
                      f"{type(module).__name__} has none")


def check_fit_export(cfg: Any, module: nn.Module) -> None:
    """Before training: whatever would stop ``export=DIR`` at the end of the run stops it now, in one line."""
    out = cfg.get("export")
    if not out:
        return
    check_out_dir(Path(str(out)).expanduser(), overwrite=False)
    model = trained_model(module)
    names = list(getattr(model, "peft_config", {}) or {})
    if len(names) > 1:
        raise ExportError(f"export= merges LoRA, and this run trains several adapters ({', '.join(names)}): leave export "
                          "out and run `lit-memopt export ckpt_path=... out=... adapter=NAME` after the run")


def export_after_fit(cfg: Any, module: nn.Module, *, is_global_zero: bool) -> float | None:
    """After ``trainer.fit``: every rank calls it; rank zero writes ``cfg.export`` from the final weights in memory.

    Under FSDP2 the full state dict is gathered (a collective, hence every rank) and offloaded to rank zero's CPU.
    The weights in memory are the final ones whatever the checkpoint settings (even enable_checkpointing=false).
    """
    out = cfg.get("export")
    if not out:
        return None
    model = trained_model(module)
    if is_fsdp_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        weights = {key: value.detach().cpu() for key, value in model.state_dict().items()} if is_global_zero else {}
    if not is_global_zero:
        return None
    return export_model(cfg.model, weights, Path(str(out)).expanduser())

"""The ``lit-memopt`` command: ``fit`` and ``validate`` a recipe, ``estimate`` its memory, run the benchmarks.

Hydra does the composition (``conf/`` groups + ``recipes/<name>.yaml`` selected by ``recipe=<name>``),
so ``--cfg job``, ``-m`` sweeps and Hydra's run directories work as usual. Bad overrides are
caught before anything is built and reported in one line that lists the valid choices.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import lit_memopt
from lit_memopt._extras import require_extra

require_extra("recipes", __name__, one_line_exit=True)  # without Hydra and the recipes: one line, no traceback
PROG = "lit-memopt"
HYDRA_COMMANDS = ("fit", "validate", "estimate", "plan")
COMMAND_HELP = {
    "fit": "train a recipe:            lit-memopt fit recipe=sft [overrides]",
    "validate": "validate from a checkpoint: lit-memopt validate recipe=sft ckpt_path=/path/last.ckpt",
    "estimate": "predict peak memory:       lit-memopt estimate recipe=grade model=qwen3_4b [gpu_memory=80GiB]",
    "plan": "the fastest setup that fits: lit-memopt plan recipe=sft model=qwen3_4b gpu_memory=24GiB",
    "export": "export to Hugging Face:    lit-memopt export ckpt_path=RUN/checkpoints/last.ckpt out=DIR [lora=adapter]",
    "benchmark": "run the benchmarks:        lit-memopt benchmark [--quick]",
}
# Hydra's own command-line flags: passed through untouched, never validated as overrides.
_HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"}
_HYDRA_FLAGS = {"-m", "--multirun", "--resolve", "--help", "-h", "--hydra-help", "--version", "--run", "-r", "--shell-completion", "-sc"}


class UsageError(Exception):
    """A user mistake on the command line or in the config; printed as one line, exit code 2."""


# ----------------------------------------------------------------------------- locations
def config_root() -> Path:
    """The folder holding ``conf/`` and ``recipes/``: inside the wheel, or the repository root."""
    packaged = Path(__file__).resolve().parent / "_configs"
    if (packaged / "conf").is_dir():
        return packaged
    repo = Path(__file__).resolve().parent.parent
    if (repo / "conf").is_dir():
        return repo
    raise UsageError(f"cannot find the conf/ folder (looked in {packaged} and {repo}); reinstall lit-memopt.")


def conf_dir() -> Path:
    return config_root() / "conf"


def recipes_dir() -> Path:
    return config_root() / "recipes"


def list_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def list_groups() -> dict[str, list[str]]:
    """Config groups (sub-folders of ``conf/``) and their options, plus the ``recipe`` group."""
    groups = {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in sorted(conf_dir().iterdir())
        if d.is_dir() and not d.name.startswith((".", "_"))
    }
    groups["recipe"] = list_recipes()
    return groups


def register_recipes() -> None:
    """Put every ``recipes/*.yaml`` into Hydra's ConfigStore as the ``recipe`` group (global package)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from lit_memopt.cli_checkpoint import register_resolvers

    register_resolvers()  # ${world_size:...} in conf/trainer/fsdp2.yaml; here because every composition passes by
    store = ConfigStore.instance()
    for path in sorted(recipes_dir().glob("*.yaml")):
        store.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")


def compose_config(overrides: Sequence[str] = ()) -> Any:
    """The composed config for ``overrides`` (e.g. ``["recipe=grade", "trainer.max_steps=5"]``), as the CLI sees it.

    For tests and notebooks: pass the result to :func:`instantiate_run`. Hydra's run-time values
    (``${hydra:...}``) stay unresolved outside a ``lit-memopt`` run.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    register_recipes()
    # Inside a running `lit-memopt` command (plan composes each plan it checks) Hydra's global state is the run's:
    # kept aside and put back, so the run's own Hydra outlives this compose.
    previous = get_gh_backup() if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            return compose(config_name="config", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()
        if previous is not None:
            restore_gh_from_backup(previous)


# ----------------------------------------------------------------------------- help
def format_help() -> str:
    lines = [
        f"{PROG} {lit_memopt.__version__}: keep LLM training inside GPU memory (Lightning + Hydra).",
        "",
        "Commands:",
        *(f"  {name:<10} {text}" for name, text in COMMAND_HELP.items()),
        "",
        f"Recipes (recipe=NAME): {', '.join(list_recipes())}",
        "",
        "Config groups (GROUP=OPTION):",
    ]
    for group, options in list_groups().items():
        if group != "recipe":
            lines.append(f"  {group:<10} {', '.join(options)}")
    lines += [
        "",
        "Any key can be overridden (trainer.max_steps=50, module.lr=3e-4); Hydra flags work too:",
        "  --cfg job (print the composed config), -m (sweep: module.lr=1e-3,3e-4), hydra.run.dir=DIR.",
        f"Examples:\n  {PROG} fit recipe=sft\n  {PROG} fit recipe=grade trainer=gpu model=qwen3_4b model.pretrained=/ckpt/qwen3-4b",
        f"  {PROG} fit recipe=ttt trainer=ddp trainer.devices=2",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- validation
def _split_hydra_flags(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate Hydra's own flags from ``key=value`` overrides."""
    flags: list[str] = []
    overrides: list[str] = []
    it = iter(args)
    for arg in it:
        if arg in _HYDRA_FLAGS_WITH_VALUE:
            flags.append(arg)
            value = next(it, None)
            if value is not None:
                flags.append(value)
        elif arg in _HYDRA_FLAGS or arg.startswith("--"):
            flags.append(arg)
        else:
            overrides.append(arg)
    return flags, overrides


def _closest(name: str, choices: Sequence[str]) -> str:
    import difflib

    match = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def check_overrides(overrides: Sequence[str]) -> None:
    """Fail with one clear line on an unknown recipe, group option or key, before anything runs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    groups = list_groups()
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise UsageError(f"cannot parse the overrides: {str(exc).splitlines()[0]}") from None
    plain: list[str] = []
    for override in parsed:
        key = override.key_or_group
        if key.startswith("hydra.") or key == "hydra":
            continue
        values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
        if key in groups and not override.is_delete():
            for value in values:
                if value is not None and str(value) not in groups[key]:
                    raise UsageError(
                        f"unknown {key} {str(value)!r}{_closest(str(value), groups[key])}; "
                        f"choose one of: {', '.join(groups[key])}"
                    )
        first = values[0] if values else None
        prefix = {"ADD": "+", "FORCE_ADD": "++", "DEL": "~"}.get(override.type.name, "")
        if override.is_delete():
            plain.append(f"~{key}" if first is None else f"~{key}={first}")
        else:
            text = override.input_line if not override.is_sweep_override() else f"{prefix}{key}={first}"
            plain.append(text)

    try:
        compose_config(plain)
    except (HydraException, OmegaConfBaseException) as exc:
        raise UsageError(_explain_compose_error(exc, plain)) from None


def _explain_compose_error(exc: Exception, overrides: Sequence[str]) -> str:
    from omegaconf import OmegaConf

    message = str(exc)
    match = re.search(r"Could not override '([^']+)'", message) or re.search(r"Key '([^']+)' is not in struct", message)
    if match:
        full_key = match.group(1)
        parent, _, leaf = full_key.rpartition(".")
        # list the keys that do exist at the parent level, from the config without the bad override
        good = [o for o in overrides if not o.lstrip("+~").startswith(full_key)]
        try:
            cfg = compose_config(good)
            node = OmegaConf.select(cfg, parent) if parent else cfg
            keys = sorted(str(k) for k in node.keys()) if node is not None and hasattr(node, "keys") else []
        except Exception:  # noqa: BLE001 - the listing is a courtesy; the first error is what matters
            keys = []
        moved = _moved_key(cfg if keys else None, parent, leaf)
        if moved:
            return f"{full_key} moved to {parent}.{moved} (the module's settings are grouped as its YAML shows)"
        where = f"under '{parent}'" if parent else "at the top level"
        hint = f"; keys {where}: {', '.join(keys)}" if keys else ""
        return f"unknown key '{full_key}'{_closest(leaf, keys)}{hint} (use +{full_key}=VALUE to add a new key)"
    first = next((line for line in message.splitlines() if line.strip()), message)
    return f"invalid overrides: {first}"


def _moved_key(cfg: Any, parent: str, leaf: str) -> str | None:
    """Where a module setting went when its module grouped its settings (a class's ``moved_keys``), else None."""
    if cfg is None or parent != "module":
        return None
    try:
        from hydra.utils import get_class

        return getattr(get_class(cfg.module["_target_"]), "moved_keys", {}).get(leaf)
    except Exception:  # noqa: BLE001 - a courtesy on top of the unknown-key message
        return None


# ----------------------------------------------------------------------------- running
class RunObjects(NamedTuple):
    model_config: Any
    tokenizer: Any
    datamodule: Any
    module: Any
    callbacks: list[Any]
    logger: Any


def instantiate_run(cfg: Any, *, prepare_model_config: Callable[[Any], Any] | None = None) -> RunObjects:
    """Build model config, tokenizer, data, module, callbacks and logger from a composed config.

    ``prepare_model_config`` (``lit-memopt estimate``) replaces the model config the module is built
    from, e.g. by one that builds fake weights.

    Objects are passed to the targets after instantiation (``_partial_``): Hydra would otherwise
    turn a dataclass argument such as ``ModelConfig`` back into a config node.
    """
    from hydra.utils import instantiate

    if "module" not in cfg or cfg.module is None:
        raise UsageError("the config has no 'module' section; pick a recipe with recipe=NAME.")
    model_config = instantiate(cfg.model)
    tokenizer = model_config.build_tokenizer()
    if prepare_model_config is not None:
        model_config = prepare_model_config(model_config)
    # _convert_="all": plain lists and dicts, so saved hyper-parameters load with torch.load(weights_only=True)
    datamodule = instantiate(cfg.data, _partial_=True, _convert_="all")(tokenizer=tokenizer)
    module = instantiate(cfg.module, _partial_=True, _convert_="all")(model_config=model_config, tokenizer=tokenizer)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    return RunObjects(model_config, tokenizer, datamodule, module, callbacks, logger)


def _user_error_message(exc: BaseException) -> str | None:
    """The message of a configuration mistake (possibly wrapped by Hydra's instantiate), else None."""
    from hydra.errors import InstantiationException

    cause: BaseException | None = exc
    while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(cause, (UsageError, ValueError, FileNotFoundError)):
        return str(cause)
    return None


def check_module_fits_strategy(cfg: Any, module: Any) -> None:
    """``trainer=fsdp2`` needs a module that shards its model in ``configure_model``: say so in one line."""
    import lightning.pytorch as pl

    strategy = cfg.trainer.get("strategy")
    target = strategy.get("_target_", "") if hasattr(strategy, "get") else str(strategy or "")
    if not str(target).endswith("ModelParallelStrategy"):
        return
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not is_overridden("configure_model", module, pl.LightningModule):
        raise UsageError(
            f"trainer=fsdp2 needs {type(module).__name__} to shard its model in configure_model(); add "
            "`def configure_model(self): lit_memopt.models.shard_for_fsdp2(self, self.model)` to the module "
            "(or pick trainer=ddp)"
        )


# Below this size a CPU step is dominated by per-op overhead, where a second intra-op thread costs more
# than it gives: the SFT recipe's default (3.2M parameters) trains in 50.0 s with 1 thread and 55.1 s with
# 2 on a 2-core machine (README), and the other core stays free (sandbox workers, a second DDP rank).
SMALL_MODEL_PARAMETERS = 100_000_000


def set_cpu_threads(cfg: Any, module: Any) -> int | None:
    """Apply ``threads`` (auto | int | null) to a CPU run; returns the thread count set, or ``None``."""
    import torch

    threads = cfg.get("threads", "auto")
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if threads is None or not on_cpu:
        return None
    if threads == "auto":
        if sum(p.numel() for p in module.parameters()) >= SMALL_MODEL_PARAMETERS:
            return None
        threads = 1
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise UsageError(f"threads must be auto, null or an int >= 1, got {threads!r}")
    torch.set_num_threads(threads)
    return threads


def _run_training(cfg: Any, command: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate

    from lit_memopt._run_summary import RunSummary, print_summary
    from lit_memopt.cli_checkpoint import check_world_size, checkpoint_callbacks, resolve_ckpt_path

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if command == "validate" and not cfg.get("ckpt_path"):
        raise UsageError("validate needs a checkpoint: add ckpt_path=/path/to/last.ckpt (or ckpt_path=last)")
    check_world_size(cfg)
    budget_value = _memory_budget_value(cfg)  # a bad memory_budget= is one line before anything is built
    ckpt_path = resolve_ckpt_path(cfg, run_dir, command)
    # built before the model: a bad `checkpoint:` setting is one line before anything heavy runs
    checkpointing = checkpoint_callbacks(cfg, run_dir) if cfg.trainer.get("enable_checkpointing", True) else []
    pl.seed_everything(int(cfg.seed), workers=True)

    run = instantiate_run(cfg)
    datamodule, module, callbacks = run.datamodule, run.module, run.callbacks
    check_module_fits_strategy(cfg, module)
    if command == "fit" and cfg.get("export"):
        from lit_memopt.export import check_fit_export

        check_fit_export(cfg, module)  # a full out folder or a non-transformers model stops the run before it trains
    set_cpu_threads(cfg, module)
    summary = RunSummary()
    callbacks.append(summary)
    callbacks += checkpointing  # the `checkpoint:` section's RunCheckpoint, and RandomState (the global generators)
    if cfg.trainer.get("enable_progress_bar", True):
        from lit_memopt._progress import StepAwareProgressBar

        callbacks.append(StepAwareProgressBar(leave=True))
    budget = _training_budget(cfg, budget_value, module)
    trainer = instantiate(cfg.trainer, _partial_=True)(callbacks=callbacks, logger=run.logger)

    if budget is not None:
        # The data a run reads (a tokenized corpus) lives in host memory, not on the device the budget stands
        # for: made before the budget starts counting (Lightning's own setup call then finds it made), so that, as
        # on a GPU, the budget holds what the steps hold. Measured: 15.7 MiB of synthetic texts at seq_len=128.
        datamodule.prepare_data()
        datamodule.setup("fit" if command == "fit" else "validate")
    started = time.perf_counter()
    with budget if budget is not None else contextlib.nullcontext():
        if command == "fit":
            if cfg.get("validate_first") and not ckpt_path:
                # The held-out numbers the run starts from (after the module's warm start, which runs in setup).
                trainer.validate(module, datamodule=datamodule, verbose=False)
            # Set before fit, not passed to it: Lightning runs the module's setup (where a warm start runs) before
            # it records a ckpt_path argument, and a resumed run must see it there to skip the warm start.
            trainer.ckpt_path = ckpt_path
            trainer.fit(module, datamodule=datamodule)
        else:
            trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt_path)
    elapsed = time.perf_counter() - started
    if budget is not None and trainer.is_global_zero:
        from lit_memopt.memory.units import format_bytes

        print(f"memory_budget: peak {format_bytes(budget.peak_bytes)} of {format_bytes(budget.budget_bytes or 0)} "
              f"(live tensor bytes, not the CUDA allocator); simulated out-of-memory errors: {budget.num_ooms}")
    result = summary.collect(trainer, module, run_dir=run_dir, seconds=elapsed, command=command)
    if trainer.is_global_zero:
        print_summary(result)
    if command == "fit" and cfg.get("export"):
        from lit_memopt.export import export_after_fit

        export_after_fit(cfg, module, is_global_zero=trainer.is_global_zero)  # every rank: FSDP2 gathers the weights
    _close_process_group(trainer)
    return result


def _close_process_group(trainer: Any) -> None:
    """End a multi-process run's process group once every rank is done with its last collective (the summary's, the
    export's). Left to the interpreter's exit, gloo's threads can outlive it: a rank then aborts with "terminate
    called without an active exception" after training (2 of 7 two-node FSDP2 runs of ``tests/test_multinode.py``
    on the 2-core CPU), and its launcher reports a failed run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        trainer.strategy.barrier("lit-memopt.end")
        dist.destroy_process_group()


def _memory_budget_value(cfg: Any) -> Any:
    """``memory_budget`` as given (``None``: off), checked to be a memory size."""
    value = cfg.get("memory_budget")
    if value is not None:
        from lit_memopt.memory.search import parse_memory_size

        parse_memory_size(value, key="memory_budget")
    return value


def _training_budget(cfg: Any, value: Any, module: Any) -> Any:
    """``fit ... memory_budget=200MiB``: the ``memory.budget`` simulator the run trains under (``None``: off).

    On a CPU run the weights built so far are its baseline; on a GPU only CUDA tensors count, and the
    weights are counted as they are copied to the device inside ``fit``.
    """
    if value is None:
        return None
    import torch

    from lit_memopt.memory.budget import training_budget

    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    return training_budget(value, module) if on_cpu else training_budget(value, device="cuda")


def _make_task(command: str, relaunch_argv: list[str]) -> Callable[[Any], Any]:
    def task(cfg: Any) -> Any:
        # Lightning's DDP launcher re-runs sys.argv[1:] in each child: keep the subcommand in it.
        sys.argv = relaunch_argv
        try:
            if command == "estimate":
                from lit_memopt.cli_estimate import run_estimate_command

                return run_estimate_command(cfg)
            if command == "plan":
                from lit_memopt.cli_plan_output import run_plan_command

                code = run_plan_command(cfg, [a for a in relaunch_argv[2:] if not a.startswith("-")])
                if code:
                    raise SystemExit(code)  # nothing fits: exit code 2, after the "does not fit" line
                return code
            return _run_training(cfg, command)
        except Exception as exc:  # noqa: BLE001 - config mistakes become one line, the rest re-raises
            message = _user_error_message(exc)
            if message is None or os.environ.get("LIT_MEMOPT_DEBUG"):
                raise
            print(f"{PROG}: error: {message}", file=sys.stderr)
            raise SystemExit(2) from None

    return task


def _run_hydra(command: str, args: list[str]) -> int:
    import hydra

    flags, overrides = _split_hydra_flags(args)
    if any(f in ("--help", "-h") for f in flags):
        print(format_help())
        return 0
    register_recipes()
    check_overrides(overrides)
    original = list(sys.argv)
    relaunch = [original[0], command, *args]
    # Hydra's parser takes no override after a flag (`... --config-dir D +experiment=x`): flags first
    sys.argv = [original[0], *flags, *overrides]
    try:
        main_fn = hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)(_make_task(command, relaunch))
        main_fn()
    finally:
        sys.argv = original
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lit-memopt`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if argv is not None:
        sys.argv = [sys.argv[0] if sys.argv else PROG, *args]
    if not args or args[0] in ("-h", "--help", "help"):
        print(format_help())
        return 0
    if args[0] == "--version":
        print(f"{PROG} {lit_memopt.__version__}")
        return 0
    command, rest = args[0], args[1:]
    try:
        if command == "benchmark":
            try:
                from benchmarks.__main__ import main as benchmark_main  # type: ignore[import-not-found]
            except ModuleNotFoundError as exc:
                if exc.name not in ("benchmarks", "benchmarks.__main__"):
                    raise
                raise UsageError(
                    "the benchmarks live in the source repository, not in the wheel: run `lit-memopt benchmark` "
                    "(or `python -m benchmarks`) from a checkout installed with `pip install -e .`"
                ) from None
            return int(benchmark_main(rest) or 0)
        if command == "export":
            return _run_export(rest)
        if command not in HYDRA_COMMANDS:
            hint = " (overrides go after a command: lit-memopt fit recipe=sft)" if "=" in command else ""
            raise UsageError(f"unknown command {command!r}{hint}; choose one of: {', '.join(COMMAND_HELP)}")
        return _run_hydra(command, rest)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


def _run_export(args: list[str]) -> int:
    """``lit-memopt export``: plain key=value options (the run's saved config is read, not composed by Hydra)."""
    from lit_memopt.export import run_export_command

    try:
        return run_export_command(args)
    except Exception as exc:  # noqa: BLE001 - user mistakes become one line, the rest re-raises
        message = _user_error_message(exc)
        if message is None or os.environ.get("LIT_MEMOPT_DEBUG"):
            raise
        raise UsageError(message) from None


def console_main() -> None:
    """The ``lit-memopt`` console script: :func:`main`, and a quick exit after an estimate.

    Tearing down an interpreter that imported Lightning, transformers and a fake 4B-parameter model
    takes over a second, a tenth of an estimate's wall time; ``estimate`` writes nothing but its
    output, so after flushing it the process ends without that teardown (as mypy does).
    """
    code = main()
    if sys.argv[1:2] in (["estimate"], ["plan"]):
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    console_main()

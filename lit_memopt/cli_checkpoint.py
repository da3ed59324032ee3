"""Checkpoints and resume for ``lit-memopt fit``/``validate``: the ``checkpoint:`` section, ``ckpt_path=last``,
``resume=auto``, and the process-group sizes of a job launched on several machines."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["register_resolvers", "world_size", "check_world_size", "checkpoint_callbacks", "newest_checkpoint",
           "resolve_ckpt_path"]

RESUME_CHOICES = (None, "auto")


def _usage_error(message: str) -> Exception:
    from lit_memopt.cli import UsageError  # here, not at the top: the CLI imports this module

    return UsageError(message)


# ----------------------------------------------------------------------------- several machines
def world_size(devices: Any, num_nodes: Any) -> int:
    """``trainer.devices x trainer.num_nodes``: the processes of the job (the ``${world_size:...}`` resolver).

    ``devices`` is a count or a list of device ids; ``"auto"`` and ``-1`` are refused, because the size of a
    process group must be known when the configuration is read.
    """
    per_node = len(devices) if isinstance(devices, (list, tuple)) or type(devices).__name__ == "ListConfig" else devices
    if isinstance(per_node, str) and per_node.isdigit():
        per_node = int(per_node)
    ok = isinstance(per_node, int) and not isinstance(per_node, bool) and per_node >= 1
    if not ok or not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
        raise ValueError(f"the process groups are sized as trainer.devices x trainer.num_nodes: set both to positive "
                         f"integers (processes per node, machines), got trainer.devices={devices!r} and "
                         f"trainer.num_nodes={num_nodes!r}")
    return per_node * num_nodes


def register_resolvers() -> None:
    """Register ``${world_size:DEVICES,NODES}`` with OmegaConf (once; ``conf/trainer/fsdp2.yaml`` uses it)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("world_size"):
        OmegaConf.register_new_resolver("world_size", world_size)


def _launched_by_torchrun() -> tuple[int, int] | None:
    """``(WORLD_SIZE, LOCAL_WORLD_SIZE)`` when this process was started by ``torchrun``, else ``None``."""
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    if not TorchElasticEnvironment.detect() or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])


def check_world_size(cfg: Any) -> None:
    """One line, before anything is built, when ``trainer.devices x trainer.num_nodes`` cannot match the launch.

    SLURM mismatches are Lightning's own ``ValueError`` (one line too); ``torchrun``'s are checked here, where the
    message can name the values to set.
    """
    trainer = cfg.trainer
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    strategy = trainer.get("strategy")
    target = str(strategy.get("_target_", "")) if hasattr(strategy, "get") else str(strategy or "")
    if target.endswith("ModelParallelStrategy"):
        try:
            world_size(devices, nodes)
        except ValueError as error:
            raise _usage_error(f"trainer=fsdp2: {error}") from None
    launched = _launched_by_torchrun()
    if launched is None or not isinstance(devices, int) or not isinstance(nodes, int):
        return
    total, per_node = launched
    if devices * nodes != total:
        raise _usage_error(
            f"torchrun started {total} processes ({per_node} per node) but trainer.devices={devices} x "
            f"trainer.num_nodes={nodes} = {devices * nodes}; set trainer.devices={per_node} "
            f"trainer.num_nodes={max(1, total // max(1, per_node))} (torchrun's --nproc-per-node and --nnodes)")


# ----------------------------------------------------------------------------- checkpoints during the run
def checkpoint_callbacks(cfg: Any, run_dir: Path) -> list[Any]:
    """``RunCheckpoint`` from the ``checkpoint:`` section (saves in ``<run dir>/checkpoints``) and ``RandomState``."""
    from lit_memopt.callbacks.random_state import RandomState
    from lit_memopt.callbacks.run_checkpoint import RunCheckpoint

    section = cfg.get("checkpoint") or {}
    signals = section.get("save_on_signals", ["SIGTERM", "SIGUSR1"])
    return [
        RunCheckpoint(
            run_dir / "checkpoints",
            every_n_steps=section.get("every_n_steps"),
            every_n_minutes=section.get("every_n_minutes", 30),
            keep_last=section.get("keep_last", 3),
            on_validation=bool(section.get("on_validation", True)),
            save_on_signals=list(signals or []),
        ),
        RandomState(),
    ]


def newest_checkpoint(folder: Path) -> Path | None:
    """The complete checkpoint of the highest step in ``folder`` (``step_NNNNNN.ckpt``), or ``None``.

    Temporary names (a write that was cut) are never chosen. A folder with only a ``last.ckpt`` (a run from before
    step names) gives that.
    """
    from lit_memopt.callbacks.run_checkpoint import is_checkpoint_name

    if not folder.is_dir():
        return None
    found = sorted((p for p in folder.iterdir() if is_checkpoint_name(p)), key=lambda p: int(p.name[5:-5]))
    if found:
        return found[-1]
    last = folder / "last.ckpt"
    return last if last.exists() else None


def resolve_ckpt_path(cfg: Any, run_dir: Path, command: str) -> str | None:
    """The checkpoint to start from: ``ckpt_path`` as given, ``last`` (the run's newest), or ``resume=auto``'s choice.

    ``resume=auto`` says in one line (rank zero) whether it resumes, and from where, or starts fresh; an explicit
    ``ckpt_path`` wins over it.
    """
    from lightning.pytorch.utilities import rank_zero_info

    ckpt_path = cfg.get("ckpt_path")
    resume = cfg.get("resume")
    if resume not in RESUME_CHOICES:
        raise _usage_error(f"resume={resume!r} is not supported; use resume=auto (resume when this run directory has a "
                           "checkpoint, else start fresh) or resume=null")
    folder = run_dir / "checkpoints"
    if ckpt_path == "last":
        newest = newest_checkpoint(folder)
        if newest is None:
            raise _usage_error(f"ckpt_path=last: no checkpoint in {folder}; give hydra.run.dir=DIR of a run that saved "
                               "one, or a path: ckpt_path=/path/to/step_000100.ckpt")
        return str(newest)
    if ckpt_path:
        if not Path(str(ckpt_path)).exists():
            # a file, or a directory for the sharded checkpoints of trainer=fsdp2
            raise _usage_error(f"ckpt_path={ckpt_path!r} is not a file (nor a sharded checkpoint directory); give the "
                               "path of a .ckpt written by a fit run, or ckpt_path=last.")
        return str(ckpt_path)
    if resume == "auto" and command == "fit":
        newest = newest_checkpoint(folder)
        if newest is None:
            rank_zero_info(f"resume=auto: no checkpoint in {folder}; starting fresh")
            return None
        rank_zero_info(f"resume=auto: resuming from {newest}")
        return str(newest)
    return None

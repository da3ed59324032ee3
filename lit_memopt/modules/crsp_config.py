"""CRSPModule's settings in small typed groups, one per section of ``module:`` in the CRSP recipes.

Each group validates its own fields and names the recipe key in its error (``module.roles.propose.weight must be
>= 0, got -1``). Hydra hands the groups to ``CRSPModule`` as plain mappings; :meth:`_Group.build` turns one into
its dataclass, nested groups included, so a recipe needs no ``_target_`` per group.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence

__all__ = ["Optim", "RoleLoss", "Roles", "MaxNewTokens", "Generation", "Reward", "SandboxSettings", "Validation",
           "MOVED_KEYS", "moved_key_error"]

# A check: (field, passes(value), what is accepted). `passes` may raise TypeError on a value of the wrong type,
# which counts as a failure, so a string where a number belongs gets the same one-line error.
_Check = tuple[str, Callable[[Any], bool], str]


def _int_at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _positive(v: Any) -> bool:
    return not isinstance(v, bool) and v > 0


def _plain(value: Any) -> Any:
    """Hydra's DictConfig/ListConfig (or any mapping/sequence) as dicts and tuples, without importing omegaconf."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return tuple(_plain(v) for v in value)
    return value


class _Group:
    """Construction from a mapping and the checks shared by every group (a mixin of frozen dataclasses)."""

    KEY: ClassVar[str]  # where the group sits in a recipe, for the error messages

    def _checks(self) -> Iterator[_Check]:
        return iter(())

    def __post_init__(self) -> None:
        for name, passes, accepted in self._checks():
            value = getattr(self, name)
            try:
                ok = bool(passes(value))
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"{self.KEY}.{name} must be {accepted}, got {value!r}.")

    @classmethod
    def build(cls, value: Any, key: str | None = None, base: Any = None) -> Any:
        """The group from ``None`` (its defaults), an instance, or a mapping of its fields (nested groups too).

        ``key`` is the group's place in the recipe when it differs from ``KEY`` (a role's ``module.roles.solve``);
        ``base`` the instance whose values the mapping's missing fields keep (its parent's default for it).
        """
        key = key or cls.KEY
        base = base if base is not None else cls()
        if value is None:
            return base
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{key} must be a mapping of {cls._field_names()}, got {type(value).__name__} {value!r}.")
        unknown = sorted(set(map(str, value)) - set(cls._field_names()))
        if unknown:
            raise ValueError(f"{key} has unknown key(s) {unknown}; its keys are {cls._field_names()}.")
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for name, item in value.items():
            nested = hints.get(name)
            if isinstance(nested, type) and issubclass(nested, _Group):
                kwargs[name] = nested.build(item, f"{key}.{name}", getattr(base, name))
            else:
                kwargs[name] = _plain(item)
        try:
            return dataclasses.replace(base, **kwargs)
        except ValueError as exc:  # a group used in several places (a role) names its generic key: name this one
            message = str(exc)
            if cls.KEY != key and message.startswith(cls.KEY + "."):
                message = key + message[len(cls.KEY):]
            raise ValueError(message) from None

    @classmethod
    def _field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]


@dataclass(frozen=True)
class Optim(_Group):
    """``module.optim``: AdamW, and the global-norm clip of the manual optimization step.

    Attributes:
        lr: AdamW learning rate (with ``roles.adapters``, each role's adapter gets ``lr * roles.<role>.weight``).
        weight_decay: AdamW weight decay.
        betas: AdamW ``(beta1, beta2)``.
        gradient_clip_val: clip applied in the manual step (``None``: off). Lightning cannot clip a manual step,
            so ``trainer.gradient_clip_val`` must stay ``null``.
    """

    KEY: ClassVar[str] = "module.optim"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    gradient_clip_val: float | None = 1.0

    def _checks(self) -> Iterator[_Check]:
        yield "lr", _positive, "> 0"
        yield "weight_decay", lambda v: v >= 0, ">= 0"
        yield "betas", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"
        yield "gradient_clip_val", lambda v: v is None or _positive(v), "> 0 or null"


@dataclass(frozen=True)
class RoleLoss(_Group):
    """``module.roles.<role>``: one role's TR-RPG term.

    Attributes:
        beta: TR-RPG regularisation towards the reference policy.
        weight: the role's weight in the step's loss (>= 0; 0 stops that role learning, its rollouts still run).
            With one optimizer for the shared policy a lower weight slows the role against the others; with
            ``roles.adapters`` it scales the learning rate of the role's adapter (AdamW would ignore a constant
            scale of the only loss an adapter gets).
    """

    KEY: ClassVar[str] = "module.roles.<role>"
    beta: float = 0.05
    weight: float = 1.0

    def _checks(self) -> Iterator[_Check]:
        yield "beta", lambda v: not isinstance(v, bool) and v >= 0, ">= 0"
        yield "weight", lambda v: not isinstance(v, bool) and v >= 0, ">= 0"


@dataclass(frozen=True)
class Roles(_Group):
    """``module.roles``: the three roles' losses and how many of each rollout a task gets.

    Attributes:
        propose, solve, critique: each role's :class:`RoleLoss` (defaults: beta 0.01, 0.05, 0.1).
        clamp: TR-RPG bound on ``|log(pi / pi_ref)|``, shared by the roles.
        num_solver_samples: answers per task (the ``n`` of the solve rate).
        critiques_per_task: solver answers critiqued per task, in ``[1, num_solver_samples]``.
        function_task_ratio: share of tasks of kind ``function`` (the rest predict outputs).
        adapters: one LoRA adapter per role (peft multi-adapter on the same base; needs ``model.lora``).
    """

    KEY: ClassVar[str] = "module.roles"
    propose: RoleLoss = field(default_factory=lambda: RoleLoss(beta=0.01))
    solve: RoleLoss = field(default_factory=lambda: RoleLoss(beta=0.05))
    critique: RoleLoss = field(default_factory=lambda: RoleLoss(beta=0.1))
    clamp: float = 2.3
    num_solver_samples: int = 4
    critiques_per_task: int = 2
    function_task_ratio: float = 0.5
    adapters: bool = False

    def of(self, role: str) -> RoleLoss:
        """The :class:`RoleLoss` of ``role`` (``propose``, ``solve`` or ``critique``)."""
        return getattr(self, role)

    def _checks(self) -> Iterator[_Check]:
        yield "clamp", _positive, "> 0"
        yield "num_solver_samples", _int_at_least(1), "an integer >= 1"
        yield ("critiques_per_task", lambda v: _int_at_least(1)(v) and v <= self.num_solver_samples,
               f"an integer in [1, num_solver_samples={self.num_solver_samples}]")
        yield "function_task_ratio", lambda v: not isinstance(v, bool) and 0.0 <= v <= 1.0, "in [0, 1]"
        yield "adapters", lambda v: isinstance(v, bool), "true or false"


@dataclass(frozen=True)
class MaxNewTokens(_Group):
    """``module.generation.max_new_tokens``: each role's response cap (tokens)."""

    KEY: ClassVar[str] = "module.generation.max_new_tokens"
    propose: int = 96
    solve: int = 32
    critique: int = 24

    def of(self, role: str) -> int:
        return getattr(self, role)

    def _checks(self) -> Iterator[_Check]:
        for role in ("propose", "solve", "critique"):
            yield role, _int_at_least(1), "an integer >= 1"


@dataclass(frozen=True)
class Generation(_Group):
    """``module.generation``: sampling, and the micro-batches of the log-prob passes.

    Attributes:
        max_new_tokens: each role's response cap (:class:`MaxNewTokens`).
        temperature: sampling temperature; the log-probs use the same.
        micro_batch_size: sequences per forward/backward and per reference pass.
        chunk_size: fused-head tile (``None``: chosen from the shapes).
    """

    KEY: ClassVar[str] = "module.generation"
    max_new_tokens: MaxNewTokens = field(default_factory=MaxNewTokens)
    temperature: float = 1.0
    micro_batch_size: int = 8
    chunk_size: int | None = None

    def _checks(self) -> Iterator[_Check]:
        yield "temperature", _positive, "> 0"
        yield "micro_batch_size", _int_at_least(1), "an integer >= 1"
        yield "chunk_size", lambda v: v is None or _int_at_least(1)(v), "an integer >= 1 or null"


@dataclass(frozen=True)
class Reward(_Group):
    """``module.reward``: shaping of the solver and critique rewards, and their normalisation.

    Attributes:
        length_max_tokens: ``L`` of the length reward ``min(1, ln n / ln L)``.
        length_penalty_threshold, length_penalty_scale: the length penalty (``None``: ``L`` and ``L / 2``).
        alpha_breakpoints: ``[(progress, alpha_s, alpha_c), ...]`` (``None``: the CRSP defaults); checked by
            :class:`~lit_memopt.rewards.crsp_rewards.AlphaSchedule`.
        normalizer_eps: added to each role's running reward std.
    """

    KEY: ClassVar[str] = "module.reward"
    length_max_tokens: int = 64
    length_penalty_threshold: int | None = None
    length_penalty_scale: float | None = None
    alpha_breakpoints: tuple[tuple[float, float, float], ...] | None = None
    normalizer_eps: float = 1e-6

    def _checks(self) -> Iterator[_Check]:
        yield "length_max_tokens", _int_at_least(2), "an integer > 1"
        yield "length_penalty_threshold", lambda v: v is None or _int_at_least(0)(v), "an integer >= 0 or null"
        yield "length_penalty_scale", lambda v: v is None or _positive(v), "> 0 or null"
        yield "normalizer_eps", lambda v: not isinstance(v, bool) and v >= 0, ">= 0"


@dataclass(frozen=True)
class SandboxSettings(_Group):
    """``module.sandbox``: where proposals and answers run (:class:`~lit_memopt.rewards.sandbox.Sandbox`).

    Attributes:
        wall_time_s, cpu_time_s, memory_mb: limits per program.
        workers: programs executed at the same time.
        require: isolation features training must not start without (``Sandbox(require=...)``).
        max_output_chars: executed outputs longer than this make a proposal invalid.
    """

    KEY: ClassVar[str] = "module.sandbox"
    wall_time_s: float = 3.0
    cpu_time_s: float = 2.0
    memory_mb: int = 512
    workers: int = 4
    require: tuple[str, ...] | str = ()
    max_output_chars: int = 200

    def _checks(self) -> Iterator[_Check]:
        yield "wall_time_s", _positive, "> 0"
        yield "cpu_time_s", _positive, "> 0"
        yield "memory_mb", _int_at_least(1), "an integer >= 1"
        yield "workers", _int_at_least(1), "an integer >= 1"
        yield "require", lambda v: isinstance(v, str) or all(isinstance(r, str) for r in v), "a feature name or a list of them"
        yield "max_output_chars", _int_at_least(1), "an integer >= 1"


@dataclass(frozen=True)
class Validation(_Group):
    """``module.validation``: the held-out solve rate.

    Attributes:
        solver_samples: answers sampled per held-out task (``val/solve_rate`` is their mean: pass@1 at the
            sampling temperature; ``val/solve_rate_stderr`` its standard error over tasks).
        greedy: also solve each held-out task by greedy decoding (``val/solve_rate_greedy``).
    """

    KEY: ClassVar[str] = "module.validation"
    solver_samples: int = 1
    greedy: bool = False

    def _checks(self) -> Iterator[_Check]:
        yield "solver_samples", _int_at_least(1), "an integer >= 1"
        yield "greedy", lambda v: isinstance(v, bool), "true or false"


# The flat keyword arguments of CRSPModule before its settings were grouped: command lines, notebooks and docs
# still spell them, so each gets a one-line error naming its new place instead of "unexpected keyword".
MOVED_KEYS: dict[str, str] = {
    "lr": "optim.lr", "weight_decay": "optim.weight_decay", "betas": "optim.betas",
    "gradient_clip_val": "optim.gradient_clip_val",
    **{f"beta_{r}": f"roles.{r}.beta" for r in ("propose", "solve", "critique")},
    **{f"weight_{r}": f"roles.{r}.weight" for r in ("propose", "solve", "critique")},
    "clamp": "roles.clamp", "num_solver_samples": "roles.num_solver_samples",
    "critiques_per_task": "roles.critiques_per_task", "function_task_ratio": "roles.function_task_ratio",
    "role_adapters": "roles.adapters",
    **{f"max_new_tokens_{r}": f"generation.max_new_tokens.{r}" for r in ("propose", "solve", "critique")},
    "temperature": "generation.temperature", "micro_batch_size": "generation.micro_batch_size",
    "chunk_size": "generation.chunk_size",
    "length_max_tokens": "reward.length_max_tokens", "length_penalty_threshold": "reward.length_penalty_threshold",
    "length_penalty_scale": "reward.length_penalty_scale", "alpha_breakpoints": "reward.alpha_breakpoints",
    "normalizer_eps": "reward.normalizer_eps",
    **{f"sandbox_{k}": f"sandbox.{k}" for k in ("wall_time_s", "cpu_time_s", "memory_mb", "workers", "require")},
    "max_output_chars": "sandbox.max_output_chars",
    "val_solver_samples": "validation.solver_samples", "val_greedy": "validation.greedy",
}


def moved_key_error(given: Mapping[str, Any]) -> ValueError:
    """The error for keyword arguments of CRSPModule that do not exist: moved ones name their new key."""
    moved = [f"module.{k} moved to module.{MOVED_KEYS[k]}" for k in given if k in MOVED_KEYS]
    unknown = [k for k in given if k not in MOVED_KEYS]
    parts = moved + ([f"unknown module key(s) {sorted(unknown)}"] if unknown else [])
    return ValueError("; ".join(parts) + ".")

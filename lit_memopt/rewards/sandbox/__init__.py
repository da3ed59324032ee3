"""Run untrusted, model-generated Python in isolated child processes and return structured verdicts.

Nothing generated ever runs in the trainer's process. :class:`Sandbox` is the entry point; the
isolation a run gets is probed once per process (:func:`probe_isolation`) and enforced from then on.
Modules: :mod:`.core` (the Sandbox, verdicts, cache), :mod:`.runner` (launching one run),
:mod:`.policy` (seccomp filter, minimal filesystem), :mod:`.cgroups` (per-slot limits),
:mod:`.probe` (what the machine grants), :mod:`._bootstrap` (the script each run starts with).
"""

from __future__ import annotations

from lit_memopt.rewards.sandbox.core import (
    MAX_PROGRAM_BYTES,
    VERDICTS,
    Sandbox,
    SandboxLimits,
    Verdict,
    _child_uid,  # re-exported: tests find a slot's processes by its uid
    verdict_summary,
)
from lit_memopt.rewards.sandbox.probe import FEATURES, probe_isolation

__all__ = ["FEATURES", "MAX_PROGRAM_BYTES", "Sandbox", "SandboxLimits", "Verdict", "VERDICTS", "probe_isolation",
           "verdict_summary"]

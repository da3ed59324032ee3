"""lit-memopt: keep LLM training inside GPU memory with Lightning callbacks, fused ops and recipes."""

from __future__ import annotations

__version__ = "0.1.0"

"""Reward functions and the sandbox that executes generated code."""

from __future__ import annotations

from lit_memopt._extras import require_extra

require_extra("recipes", __name__)  # one line naming the extra, before any import of its packages

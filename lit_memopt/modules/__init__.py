"""LightningModules for the pack's training methods, built on ``lit_memopt.ops``."""

from __future__ import annotations

from lit_memopt._extras import require_extra
from lit_memopt._lazy import lazy_exports

require_extra("recipes", __name__)  # one line naming the extra, before any import of its packages

# name -> submodule (relative to this package). One method per file.
_EXPORTS = {
    "SFTModule": ".sft",
    "GradeModule": ".grade",
    "TTTModule": ".ttt",
    "CRSPModule": ".crsp",
    "IntuitorModule": ".intuitor",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

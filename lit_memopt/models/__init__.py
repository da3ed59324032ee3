"""Model and tokenizer construction from configs (no downloads), plus the pack's own architectures."""

from __future__ import annotations

from lit_memopt._extras import require_extra
from lit_memopt._lazy import lazy_exports

require_extra("recipes", __name__)  # one line naming the extra, before any import of its packages

_EXPORTS = {
    "ModelConfig": ".hf",
    "build_tokenizer": ".hf",
    "CharTokenizer": ".char_tokenizer",
    "resolve_dtype": ".hf",
    "lm_head_weight": ".hf",
    "decoder_of": ".hf",
    "decoder_hidden_states": ".hf",
    "decoder_outputs": ".hf",
    "shard_for_fsdp2": ".sharding",
    "shard_blocks_and_root": ".sharding",
    "is_fsdp_sharded": ".sharding",
    "TTTConfig": ".ttt",
    "TTTLinear": ".ttt",
    "TTTMLP": ".ttt",
    "TTTIntegrationConfig": ".ttt",
    "add_ttt_layers": ".ttt",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

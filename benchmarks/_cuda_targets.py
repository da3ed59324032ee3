"""Issue 43's GPU targets, judged on a ``benchmarks/peers_cuda.py`` result at the Qwen3-4B head in bf16.

* the SFT loss (cross-entropy), the GRPO loss and frozen-head log-probs: lit-memopt's path at most
  :data:`VS_FASTEST_PEER` times the fastest peer's time (paired over the same repetitions), with at most
  :data:`MEMORY_VS_LOGITS_HOLDING` of the extra memory of TRL's logits-holding ``selective_log_softmax`` (where TRL
  computes the op; else of the naive path, which holds the logits too);
* trainable-head per-token log-probs within :data:`VS_OWN_FLOOR` of their own four-product floor;
* every lit-memopt path's extra memory at most :data:`MEMORY_VS_NAIVE` of the naive path's.

A verdict's ``met`` is ``None`` where it cannot be judged (a method or peer did not run), with the reason.
"""

from __future__ import annotations

from typing import Any

from benchmarks._peer_measure import paired_ratio
from benchmarks._peer_methods import FAKE_MEMORY_SHAPE, LIT_FAST, LIT_FUSED_GRPO_FAST, LIT_METHODS, NAIVE
from lit_memopt.memory.units import format_bytes

VS_FASTEST_PEER = 1.0
MEMORY_VS_LOGITS_HOLDING = 0.1
VS_OWN_FLOOR = 1.15
MEMORY_VS_NAIVE = 0.02
LOGITS_HOLDING_PEER = "TRL full logits"
# The path each target judges: what the recipes run on a GPU in bf16 (the scalar losses make their gradients in the
# forward; GRPO through linear_policy_loss).
AGAINST_PEERS = {"cross_entropy": ("SFT loss", LIT_FAST), "grpo": ("GRPO loss", LIT_FUSED_GRPO_FAST),
                 "frozen_logprobs": ("frozen-head log-probs", LIT_FAST)}
AGAINST_FLOOR = {"logprobs": ("trainable-head log-probs", LIT_FAST)}
SHAPE = FAKE_MEMORY_SHAPE  # N=8192, H=2560, V=151936


def _vs_peers(case: dict[str, Any], label: str, method: str) -> dict[str, Any]:
    target = (f"bf16 {label}: {method} <= {VS_FASTEST_PEER}x the fastest peer's time, extra memory <= "
              f"{MEMORY_VS_LOGITS_HOLDING}x the logits-holding path's")
    rows = {r["method"]: r for r in case["rows"]}
    ours = rows.get(method)
    peers = [r for r in case["rows"] if r.get("peer")]
    if ours is None or not peers:
        return {"target": target, "met": None, "detail": f"{method} did not run" if ours is None else "no peer ran"}
    fastest = min(peers, key=lambda r: paired_ratio(case["times"], r["method"], method))
    ratio = paired_ratio(case["times"], method, fastest["method"])
    held = next((r for r in peers if r["peer"] == LOGITS_HOLDING_PEER), None) or rows.get(NAIVE)
    detail = f"{ratio:.2f}x {fastest['method']} ({ours['median_ms']:.2f} vs {fastest['median_ms']:.2f} ms)"
    met: bool | None = ratio <= VS_FASTEST_PEER
    if held is None or held.get("extra_bytes") is None or ours.get("extra_bytes") is None:
        detail += "; no logits-holding path's memory to compare with"
        met = None
    else:
        share = ours["extra_bytes"] / max(held["extra_bytes"], 1)
        detail += f"; extra memory {format_bytes(ours['extra_bytes'])}, {share:.3f}x {held['method']}'s {format_bytes(held['extra_bytes'])}"
        met = met and share <= MEMORY_VS_LOGITS_HOLDING
    return {"target": target, "met": met, "ratio": ratio, "detail": detail}


def _vs_floor(case: dict[str, Any], label: str, method: str) -> dict[str, Any]:
    target = f"bf16 {label}: {method} <= {VS_OWN_FLOOR}x its own product floor"
    row = next((r for r in case["rows"] if r["method"] == method), None)
    if row is None or "ratio_vs_own_floor" not in row:
        return {"target": target, "met": None, "detail": f"{method} or its floor did not run"}
    ratio = row["ratio_vs_own_floor"]
    return {"target": target, "met": ratio <= VS_OWN_FLOOR, "ratio": ratio,
            "detail": f"{ratio:.2f}x ({row['products']} products: {row['own_floor']})"}


def _memory_vs_naive(case: dict[str, Any]) -> list[dict[str, Any]]:
    rows = {r["method"]: r for r in case["rows"]}
    naive = (rows.get(NAIVE) or {}).get("extra_bytes")
    out = []
    for method in LIT_METHODS:
        ours = (rows.get(method) or {}).get("extra_bytes")
        if ours is None or not naive:
            continue
        out.append({"target": f"bf16 {case['op']} {method}: extra memory <= {MEMORY_VS_NAIVE:.0%} of naive",
                    "met": ours / naive <= MEMORY_VS_NAIVE, "ratio": ours / naive,
                    "detail": f"{ours / naive:.2%} ({format_bytes(ours)} against {format_bytes(naive)})"})
    return out


def judge_cuda(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets above, on the cases of ``result`` at the Qwen3-4B head in bf16 (others are not judged)."""
    verdicts = []
    for case in result["cases"]:
        if case["dtype"] != "bfloat16" or case["shape"] != SHAPE or not case.get("times"):
            continue
        if case["op"] in AGAINST_PEERS:
            verdicts.append(_vs_peers(case, *AGAINST_PEERS[case["op"]]))
        if case["op"] in AGAINST_FLOOR:
            verdicts.append(_vs_floor(case, *AGAINST_FLOOR[case["op"]]))
        verdicts += _memory_vs_naive(case)
    return verdicts


def verdict_lines(verdicts: list[dict[str, Any]]) -> list[str]:
    """The verdicts as markdown list items: met, missed, or not judged with the reason."""
    mark = {True: "met", False: "**missed**", None: "not judged"}
    return [f"- {mark[v['met']]}: {v['target']}: {v['detail']}" for v in verdicts]

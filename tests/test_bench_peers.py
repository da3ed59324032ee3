"""The peers benchmark's comparison functions: lit-memopt against float64, absent peers reported
(the bench extra is not installed in CI, so every test here passes without the peers)."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import peers

TINY = {"tokens": 64, "hidden": 32, "vocab": 500}


def _missing_peer() -> dict:
    raise ImportError("No module named 'not_a_peer'")


@pytest.fixture
def only_a_missing_peer(monkeypatch: pytest.MonkeyPatch) -> dict[str, peers.Peer]:
    monkeypatch.setattr(peers, "PEER_LOADERS", {"TRL chunked": ("not-a-peer", _missing_peer)})
    return peers.load_peers()


def test_a_peer_that_cannot_import_is_absent_with_its_error(only_a_missing_peer: dict[str, peers.Peer]) -> None:
    peer = only_a_missing_peer["TRL chunked"]
    assert not peer.available and peer.version is None
    assert peer.error == "ImportError: No module named 'not_a_peer'"
    c = peers.compare("logprobs", torch.float32, TINY, 1, only_a_missing_peer, sequence_length=16)
    assert [r["method"] for r in c["rows"]] == [peers.NAIVE, peers.LIT_EXACT, peers.FLOOR_HOLDING, peers.FLOOR_RECOMPUTING]
    floors = [r for r in c["rows"] if r.get("floor")]
    assert len(floors) == 2 and all("value_err" not in r and r["median_s"] > 0 for r in floors)
    assert c["absent"] == [{"peer": "TRL chunked", "method": "TRL ChunkedLogProbFunction", "error": peer.error}]


@pytest.mark.parametrize("op", peers.OPS)
def test_lit_memopt_exact_matches_float64(op: str, only_a_missing_peer: dict[str, peers.Peer]) -> None:
    c = peers.compare(op, torch.float32, TINY, 0, only_a_missing_peer, sequence_length=16, count=False)
    rows = {r["method"]: r for r in c["rows"]}
    scale = c["reference_scale"]
    for name in (peers.LIT_EXACT,) + ((peers.LIT_FUSED_GRPO,) if op == "grpo" else ()):
        lit = rows[name]
        assert lit["value_err"] <= 1e-5 * max(1.0, scale["value_max"])
        assert lit["grad_hidden_err"] <= 1e-5 * scale["grad_hidden_max"]
        if op == "frozen_logprobs":  # a frozen head: no weight gradient, in the reference or in any method
            assert lit["grad_weight_err"] is None and scale["grad_weight_max"] is None
        else:
            assert lit["grad_weight_err"] <= 1e-5 * scale["grad_weight_max"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", peers.OPS)
def test_each_path_makes_the_head_products_its_floor_assumes(op: str, dtype: torch.dtype) -> None:
    """The product count each row's floor is chosen by is what the path multiplies: counted by FLOPs for the naive
    path and every lit-memopt path (two for a frozen head, three for a scalar loss, four for trainable per-token
    outputs), and a floor row of that many products exists in the case."""
    methods, _ = peers.methods_for(op, dtype, {})
    x = peers.make_inputs(peers.COUNT_SHAPE, dtype, sequence_length=peers.COUNT_SEQUENCE_LENGTH)
    peers.add_grpo_logps(x, peers.COUNT_SEQUENCE_LENGTH)
    floors = {m.name for m in peers.product_floors(op)}
    expected = {"frozen_logprobs": 2, "cross_entropy": 3}.get(op, 4)
    for m in methods:
        assert not m.products_from  # none of these is read from code: each is counted
        assert peers.count_products(m, x) == {"counted": float(m.products)}, m.name
        assert peers.own_floor(m) in floors
        if m.name in peers.LIT_METHODS:
            assert m.products == (3 if m.name in (peers.LIT_FUSED_GRPO, peers.LIT_FUSED_GRPO_FAST) else expected)


def test_the_floors_make_the_products_they_name() -> None:
    x = peers.make_inputs(peers.COUNT_SHAPE, torch.float32)
    for op in peers.OPS:
        for floor in peers.product_floors(op):
            assert peers.FLOOR_BY_PRODUCTS[(floor.products, floor.frozen)] == floor.name
            assert peers.count_products(floor, x) == {"counted": float(floor.products)}, floor.name
            peers.objective(floor.fn(x), x).backward()
            assert (x["weight"].grad is None) == floor.frozen
            x["hidden"].grad = x["weight"].grad = None


def test_a_custom_op_is_reported_as_uncounted() -> None:
    x = peers.make_inputs(TINY, torch.float32)
    chunked = peers.load_peers(["torch chunked"])["torch chunked"]
    if not chunked.available:
        pytest.skip(chunked.error)
    lce, options = chunked.api["linear_cross_entropy"], chunked.api["options"]()
    method = peers.Method("torch chunked", lambda x: lce(x["hidden"], x["weight"], x["targets"], options=options))
    assert "custom ops hide their products" in peers.count_products(method, x)["count_error"]


@pytest.mark.parametrize("op", ["cross_entropy", "frozen_logprobs", "grpo"])
def test_each_row_is_timed_beside_its_own_floor(op: str, only_a_missing_peer: dict[str, peers.Peer]) -> None:
    c = peers.compare(op, torch.bfloat16, TINY, 2, only_a_missing_peer, sequence_length=16)
    rows = {r["method"]: r for r in c["rows"]}
    floor = {"cross_entropy": peers.FLOOR_HOLDING, "frozen_logprobs": peers.FLOOR_FROZEN, "grpo": peers.FLOOR_HOLDING}[op]
    name = peers.LIT_FUSED_GRPO_FAST if op == "grpo" else peers.LIT_FAST
    assert rows[name]["own_floor"] == floor and rows[name]["ratio_vs_own_floor"] > 0
    assert rows[name]["counted"] == rows[name]["products"] and rows[floor]["floor"]
    markdown = peers.to_markdown({"quick": True, "command": "test", "torch": torch.__version__, "machine": peers.machine(),
                                  "triton": None, "peers": [], "targets": peers.judge({"time": [c], "memory_fake": []}),
                                  "time": [c], "memory_real": [], "memory_fake": []})
    assert f"| {name} | " in markdown and " ✓ | " in markdown


def test_the_sft_and_frozen_targets_compare_with_cut_cross_entropy_and_each_path_with_its_floor() -> None:
    row = {"value_err": 1e-3, "grad_hidden_err": 1e-3, "grad_weight_err": 1e-3, "median_s": 1.0, "ratio_vs_naive": 1.0}

    def case(op: str, dtype: str, ours: list[float], cce: list[float], floor: list[float]) -> dict:
        name = peers.LIT_EXACT if dtype == "float32" else peers.LIT_FAST
        own = peers.FLOOR_FROZEN if op == "frozen_logprobs" else peers.FLOOR_HOLDING
        times = {name: ours, "cce": cce, own: floor, peers.LIT_EXACT: ours}
        ratio = peers.paired_ratio(times, name, own)
        return {"op": op, "dtype": dtype, "shape": peers.TIME_SHAPE, "times": times,
                "rows": [{"method": name, **row, "own_floor": own, "products": 3, "ratio_vs_own_floor": ratio},
                         {"method": "cce", "peer": "Cut Cross-Entropy", **row}, {"method": own, "floor": True}]}

    result = {"time": [case("cross_entropy", "float32", [0.9, 1.0], [1.0, 1.0], [0.85, 0.9]),
                       case("cross_entropy", "bfloat16", [1.1, 1.2], [1.0, 1.0], [0.9, 0.9]),
                       case("frozen_logprobs", "float32", [1.0, 1.0], [1.0, 1.0], [0.5, 0.5])],
              "memory_fake": []}
    by_target = {v["target"]: v for v in peers.judge(result)}
    assert by_target['float32 SFT loss (cross-entropy, mean, trainable head): lit-memopt "exact" <= 1.0x Cut Cross-Entropy\'s time']["met"] is True
    assert by_target['bfloat16 SFT loss (cross-entropy, mean, trainable head): lit-memopt "fast" <= 1.0x Cut Cross-Entropy\'s time']["met"] is False
    frozen = 'float32 frozen-head log-probs: lit-memopt "exact" <= 1.0x Cut Cross-Entropy\'s time (frozen classifier)'
    assert by_target[frozen]["met"] is True  # equal time meets "at most"
    assert by_target['float32 cross_entropy lit-memopt "exact": <= 1.15x its own product floor']["met"] is True  # 1.09x
    assert by_target['bfloat16 cross_entropy lit-memopt "fast": <= 1.15x its own product floor']["met"] is False
    assert by_target['float32 frozen_logprobs lit-memopt "exact": <= 1.15x its own product floor']["met"] is False


def test_bf16_exact_is_more_accurate_than_full_bf16_logits(only_a_missing_peer: dict[str, peers.Peer]) -> None:
    c = peers.compare("logprobs_entropy", torch.bfloat16, TINY, 0, only_a_missing_peer, sequence_length=16)
    rows = {r["method"]: r for r in c["rows"]}
    # "exact" multiplies fp32 tiles: only the inputs' rounding remains, far below bf16 logits' error.
    assert rows[peers.LIT_EXACT]["value_err"] < 1e-4 < rows[peers.NAIVE]["value_err"]
    # "fast" rounds logits to bf16 like the naive path, and no worse than it.
    assert rows[peers.LIT_FAST]["value_err"] <= 2 * rows[peers.NAIVE]["value_err"]


def test_quick_run_reports_targets_and_absent_peers(only_a_missing_peer: dict[str, peers.Peer]) -> None:
    result = peers.run(quick=True, write=False, ops=("logprobs",), fake=False)
    assert [p["error"] for p in result["peers"]] == ["ImportError: No module named 'not_a_peer'"]
    fp32 = next(c for c in result["time"] if c["dtype"] == "float32")
    assert all(r["ratio_vs_naive"] > 0 for r in fp32["rows"])
    by_target = {v["target"]: v for v in result["targets"]}
    # No Cut Cross-Entropy and no peer at all: the targets are not judged, and say why.
    assert by_target["bf16 logprobs: fast <= 1.0x Cut Cross-Entropy time, errors no larger"]["met"] is None
    assert by_target["fp32 logprobs: <= 1.0x the fastest peer"]["met"] is None
    markdown = peers.to_markdown(result)
    assert "**absent** — `ImportError: No module named 'not_a_peer'`" in markdown


def test_judge_compares_with_the_peer_in_the_same_repetitions() -> None:
    row = {"value_err": 1e-3, "grad_hidden_err": 1e-3, "grad_weight_err": 1e-3}
    result = {
        "time": [{
            "op": "logprobs", "dtype": "bfloat16", "shape": peers.TIME_SHAPE, "times": {peers.LIT_FAST: [2.0, 2.2, 2.0], "cce": [1.0, 2.0, 1.0]},
            "rows": [{"method": peers.LIT_FAST, **row}, {"method": "cce", "peer": "Cut Cross-Entropy", **row}],
        }],
        "memory_fake": [],
    }
    (verdict,) = peers.judge(result)
    assert verdict["ratio"] == pytest.approx(2.0) and verdict["met"] is False
    result["time"][0]["times"][peers.LIT_FAST] = [0.9, 1.0, 0.9]
    (verdict,) = peers.judge(result)
    assert verdict["met"] is True
    result["time"][0]["rows"][0]["grad_hidden_err"] = 2e-3  # faster, but less exact than the peer
    (verdict,) = peers.judge(result)
    assert verdict["met"] is False
    result["time"][0]["shape"] = peers.TIME_SHAPE_QUICK  # the targets are defined at the full shape only
    (verdict,) = peers.judge(result)
    assert verdict["met"] is None


@pytest.mark.parametrize("recompute", [False, True], ids=["held", "recomputed"])
def test_the_product_floors_make_a_log_prob_steps_head_products(recompute: bool) -> None:
    """The timing references are what they claim: the forward's logits product and, in the backward, the hidden and
    weight gradients of a logits-shaped operand (the logits, kept or multiplied again)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    floor = {m.name: m for m in peers.product_floors()}[peers.FLOOR_RECOMPUTING if recompute else peers.FLOOR_HOLDING]
    assert floor.floor
    (out,) = floor.fn({"hidden": hidden, "weight": weight})
    logits = hidden.detach() @ weight.detach().t()
    torch.testing.assert_close(out, logits[:, 0].float())
    out.sum().backward()
    torch.testing.assert_close(hidden.grad, logits @ weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(weight.grad, logits.t() @ hidden.detach(), rtol=0, atol=0)


def test_the_targets_say_what_the_bare_products_took_against_the_peer() -> None:
    row = {"value_err": 1e-3, "grad_hidden_err": 1e-3, "grad_weight_err": 1e-3}
    times = {peers.LIT_FAST: [1.3, 1.3, 1.3], "cce": [1.0, 1.0, 1.0],
             peers.FLOOR_RECOMPUTING: [1.2, 1.2, 1.2], peers.FLOOR_HOLDING: [0.9, 0.9, 0.9]}
    result = {"time": [{"op": "logprobs", "dtype": "bfloat16", "shape": peers.TIME_SHAPE, "times": times,
                        "rows": [{"method": peers.LIT_FAST, **row}, {"method": "cce", "peer": "Cut Cross-Entropy", **row},
                                 {"method": peers.FLOOR_RECOMPUTING, "floor": True},
                                 {"method": peers.FLOOR_HOLDING, "floor": True}]}],
              "memory_fake": []}
    (verdict,) = peers.judge(result)
    assert verdict["met"] is False
    assert "the products alone took 1.20x CCE with the logits recomputed (four), 0.90x held (three)" in verdict["detail"]


@pytest.fixture
def cuda_timers_stubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU benchmarks' synchronisation and allocator counters as no-ops, so their cases run on the CPU."""
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)


def test_the_gpu_benchmark_times_compiled_against_eager_tiles_and_leaves_the_setting_alone(
        only_a_missing_peer: dict[str, peers.Peer], cuda_timers_stubbed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # benchmarks/peers_cuda.py's comparison, run on the CPU with the CUDA timers and counters stubbed.
    from benchmarks import peers_cuda

    monkeypatch.setenv("LIT_MEMOPT_FUSED_TILES", "auto")
    monkeypatch.delenv("LIT_MEMOPT_WHOLE_PASS", raising=False)
    c = peers_cuda.compare("logprobs", torch.bfloat16, TINY, 2, only_a_missing_peer, exact=True, memory=True, device="cpu")
    rows = {r["method"]: r for r in c["rows"]}
    assert list(rows) == [peers.NAIVE, peers.LIT_EXACT, peers.LIT_FAST, peers_cuda.LIT_FAST_TILE_BY_TILE, peers_cuda.LIT_FAST_EAGER]
    assert all(len(c["times"][name]) == 2 for name in rows)
    # the same maths either way, and the user's setting is back once the eager-tiles method has run
    assert rows[peers_cuda.LIT_FAST_EAGER]["value_err"] == rows[peers.LIT_FAST]["value_err"]
    assert rows[peers_cuda.LIT_FAST_TILE_BY_TILE]["value_err"] == rows[peers.LIT_FAST]["value_err"]
    assert os.environ["LIT_MEMOPT_FUSED_TILES"] == "auto" and "LIT_MEMOPT_WHOLE_PASS" not in os.environ
    assert c["absent"] and "TRL ChunkedLogProbFunction" in peers_cuda.to_markdown(
        {"gpu": "test", "torch": torch.__version__, "triton": None, "command": "test", "peers": [], "cases": [c]})


def test_the_gpu_tile_sweep_runs_each_tile_size_and_the_automatic_choice(
        only_a_missing_peer: dict[str, peers.Peer], cuda_timers_stubbed: None) -> None:
    # benchmarks/tile_sweep_cuda.py's case, run on the CPU with the CUDA timers and counters stubbed.
    from benchmarks import tile_sweep_cuda

    c = tile_sweep_cuda.sweep_case(torch.float32, "exact", only_a_missing_peer, shape=TINY, vocab_tiles=(128, 500),
                                   reps=2, device="cpu")
    names = [r["method"] for r in c["rows"]]
    assert names == [peers.NAIVE, 'lit-memopt "exact", automatic tiles', 'lit-memopt "exact", tiles 64x128',
                     'lit-memopt "exact", tiles 64x500']
    assert all(r["median_ms"] > 0 and r["ratio_vs_cce"] is None for r in c["rows"])  # Cut Cross-Entropy is absent
    assert c["automatic_tiles"][0] == TINY["tokens"] and "aten::mm" in c["profile"]
    report = tile_sweep_cuda.to_markdown({"gpu": "test", "torch": torch.__version__, "cuda_min_tile_elements": 1, "cases": [c]})
    assert "tiles 64x128" in report and "N=64, H=32, V=500 (2 repetitions" in report


def test_the_gpu_rl_shapes_time_masked_rows_against_the_unmasked_call(cuda_timers_stubbed: None) -> None:
    # benchmarks/rl_shapes_cuda.py's masked case, run on the CPU with the CUDA timers and counters stubbed.
    from benchmarks import rl_shapes_cuda

    c = rl_shapes_cuda.masked_case(TINY["tokens"], 2, head={"hidden": TINY["hidden"], "vocab": TINY["vocab"]}, device="cpu",
                                   sequence_length=16)
    assert c["counted_rows"] == 16  # the last 4 of each 16-token sequence
    assert [r["method"] for r in c["rows"]] == [peers.LIT_FAST, rl_shapes_cuda.MASKED]
    assert all(r["median_ms"] > 0 for r in c["rows"]) and c["time_ratio"] > 0
    report = rl_shapes_cuda.masked_markdown([c])
    assert "75% of rows ignored" in report and "| 64 | 16 |" in report


def test_the_gpu_rl_shapes_time_an_fp32_head_under_autocast(cuda_timers_stubbed: None) -> None:
    # benchmarks/rl_shapes_cuda.py's autocast case, run on the CPU (CPU autocast) with the CUDA counters stubbed.
    from benchmarks import rl_shapes_cuda

    c = rl_shapes_cuda.autocast_case(TINY["tokens"], 2, head={"hidden": TINY["hidden"], "vocab": TINY["vocab"]}, device="cpu")
    assert [r["method"] for r in c["rows"]] == [rl_shapes_cuda.AUTOCAST_NAIVE, rl_shapes_cuda.AUTOCAST_LIT]
    assert all(r["median_ms"] > 0 for r in c["rows"]) and c["time_ratio"] > 0
    assert "| 64 |" in rl_shapes_cuda.autocast_markdown([c])


def test_the_gpu_only_benchmarks_say_so_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import rl_shapes_cuda, tile_sweep_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for module in (rl_shapes_cuda, tile_sweep_cuda):
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            module.main()


def test_a_partial_run_names_its_pieces_and_runs_only_them(only_a_missing_peer: dict[str, peers.Peer],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert peers.result_stem("cpu", False) == "peers_cpu"
    assert peers.result_stem("cpu", False, ("cross_entropy",), ("bfloat16",)) == "peers_cpu_bfloat16_cross_entropy"
    assert peers.result_stem("cuda", True, peers.OPS, ("float32",), memory=False) == "peers_cuda_quick_float32_time_only"
    written = {}
    monkeypatch.setattr(peers, "write_results", lambda stem, result, markdown: written.update(
        stem=stem, result=result, markdown=markdown) or [f"{stem}.md"])
    # the command line's order does not matter: the stem and the command follow OPS and DTYPES
    assert peers.main(["--quick", "--ops", "frozen_logprobs", "cross_entropy", "--dtypes", "float32", "--no-memory"]) == 0
    result = written["result"]
    assert written["stem"] == "peers_cpu_quick_float32_cross_entropy_frozen_logprobs_time_only"
    assert [(c["op"], c["dtype"]) for c in result["time"]] == [("cross_entropy", "float32"), ("frozen_logprobs", "float32")]
    assert result["memory_real"] == [] and result["memory_fake"] == []
    assert result["command"] == ("python benchmarks/peers.py --quick --ops cross_entropy frozen_logprobs "
                                 "--dtypes float32 --no-memory")
    assert "cross_entropy" in written["markdown"]
    with pytest.raises(SystemExit):
        peers.main(["--ops", "not_an_op"])


def test_the_gpu_benchmark_times_each_paths_own_product_floor_beside_it(
        only_a_missing_peer: dict[str, peers.Peer], cuda_timers_stubbed: None) -> None:
    # --must-show's cases: the floors in the same repetitions, each lit-memopt path against its own, no variants
    from benchmarks import peers_cuda

    c = peers_cuda.compare("logprobs", torch.bfloat16, TINY, 2, only_a_missing_peer, exact=False, memory=True,
                           device="cpu", floors=True, variants=False)
    rows = {r["method"]: r for r in c["rows"]}
    assert list(rows) == [peers.NAIVE, peers.LIT_EXACT, peers.LIT_FAST, peers.FLOOR_HOLDING, peers.FLOOR_RECOMPUTING]
    assert rows[peers.FLOOR_HOLDING]["floor"] and rows[peers.FLOOR_RECOMPUTING]["floor"]
    fast = rows[peers.LIT_FAST]
    assert fast["own_floor"] == peers.FLOOR_RECOMPUTING and fast["products"] == 4
    from benchmarks._peer_measure import paired_ratio

    assert fast["ratio_vs_own_floor"] == paired_ratio(c["times"], peers.LIT_FAST, peers.FLOOR_RECOMPUTING)
    assert "ratio_vs_own_floor" not in rows[peers.FLOOR_HOLDING]
    table = peers_cuda.to_markdown({"gpu": "test", "torch": torch.__version__, "triton": None, "command": "test",
                                    "peers": [], "cases": [c]})
    assert f"| {fast['ratio_vs_own_floor']:.2f}x |" in table.split(f"| {peers.LIT_FAST} |")[1].splitlines()[0]


def test_issue_43s_gpu_targets_are_judged_on_the_4b_head_only() -> None:
    from benchmarks._cuda_targets import SHAPE, judge_cuda, verdict_lines

    gib = 2**30

    def case(op: str, rows: list[dict], times: dict[str, list[float]], shape: dict = SHAPE) -> dict:
        return {"op": op, "dtype": "bfloat16", "shape": shape, "rows": rows, "times": times}

    trl, naive = "TRL selective_log_softmax", peers.NAIVE
    frozen = case("frozen_logprobs", [
        {"method": naive, "median_ms": 40.0, "extra_bytes": 8 * gib},
        {"method": peers.LIT_FAST, "median_ms": 20.0, "extra_bytes": gib // 5},
        {"method": trl, "peer": "TRL full logits", "median_ms": 25.0, "extra_bytes": 4 * gib}],
        {naive: [40.0] * 3, peers.LIT_FAST: [20.0] * 3, trl: [25.0] * 3})
    # the same numbers, but lit-memopt's path slower than the peer and holding half of its memory
    slow = case("frozen_logprobs", [dict(r, median_ms=30.0, extra_bytes=2 * gib) if r["method"] == peers.LIT_FAST else r
                                    for r in frozen["rows"]], {**frozen["times"], peers.LIT_FAST: [30.0] * 3})
    floor = case("logprobs", [{"method": peers.LIT_FAST, "median_ms": 50.0, "products": 4,
                               "own_floor": peers.FLOOR_RECOMPUTING, "ratio_vs_own_floor": 1.4}], {peers.LIT_FAST: [50.0]})
    grpo_without_peers = case("grpo", [{"method": peers.LIT_FUSED_GRPO_FAST, "median_ms": 9.0}], {peers.LIT_FUSED_GRPO_FAST: [9.0]})
    small = dict(frozen, shape=peers.TIME_SHAPE)  # not the target's shape: not judged
    verdicts = judge_cuda({"cases": [frozen, slow, floor, grpo_without_peers, small]})
    against_peers = [v for v in verdicts if "fastest peer" in v["target"]]
    assert [v["met"] for v in against_peers] == [True, False, None]
    assert abs(against_peers[0]["ratio"] - 0.8) < 1e-12 and "0.050x TRL selective_log_softmax's 4.00 GiB" in against_peers[0]["detail"]
    assert "did not run" not in against_peers[2]["detail"] and against_peers[2]["detail"] == "no peer ran"
    (vs_floor,) = [v for v in verdicts if "own product floor" in v["target"]]
    assert vs_floor["met"] is False and vs_floor["detail"] == f"1.40x (4 products: {peers.FLOOR_RECOMPUTING})"
    memory = [v for v in verdicts if "of naive" in v["target"]]
    assert [v["met"] for v in memory] == [False, False]  # 2.5% and 25% of naive's 8 GiB: above 2%
    lines = verdict_lines(verdicts)
    assert lines[0].startswith("- met: bf16 frozen-head log-probs") and lines[1].startswith("- **missed**")

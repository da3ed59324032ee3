"""The masked-rows benchmark runs (quick shape) and reports through `python -m benchmarks`' table rows;
masked rows allocate less than unmasked ones (memory is deterministic; time is the benchmark's business)."""

from benchmarks.__main__ import normalise
from benchmarks.masked_rows import run


def test_quick_run_reports_rows_and_masked_rows_take_less_memory() -> None:
    result = run(quick=True, write=False)
    assert set(result["cases"]) == {"fp32 · exact", "bf16 · fast"}
    for case in result["cases"].values():
        assert case["masked_extra_bytes"] < case["unmasked_extra_bytes"]
    rows = normalise("masked_rows", result)
    assert len(rows) == 4 and all(r["pass"] in (True, False) and r["ratio"] > 0 for r in rows)

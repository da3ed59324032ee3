"""``benchmarks/plan_cuda.py``, the GPU check of ``lit-memopt plan``: its schedule and verdicts on made-up rows, and
its dry run on the CPU (the tiny model under ``memory_budget``, the same code path as on a GPU but the cap)."""

from __future__ import annotations

import json

import pytest

from benchmarks.plan_cuda import ORDERED_PLANS, check, judge, main, schedule


def _row(overrides: list[str], predicted: float, **measured: object) -> dict:
    return {"plan": " ".join(overrides) or "as given", "overrides": overrides, "predicted_peak_bytes": 0,
            "predicted_s": predicted, "predicted_relative": predicted, **measured}


def test_a_plan_chosen_at_two_budgets_runs_once_under_the_smaller() -> None:
    planned = {"lora": [{"budget": "40GiB", "rows": [_row(["a"], 1.0), _row(["b"], 2.0)]},
                        {"budget": "24GiB", "rows": [_row(["b"], 2.0), _row(["c"], 3.0)]}],
               "full": [{"budget": "24GiB", "rows": [_row(["b"], 5.0)]}]}
    assert schedule(planned) == [("lora", ("b",), "24GiB"), ("lora", ("c",), "24GiB"), ("lora", ("a",), "40GiB"),
                                 ("full", ("b",), "24GiB")]  # the same overrides of another case are another run


def test_the_verdicts_need_every_plan_to_fit_and_enough_of_them_ordered() -> None:
    def ran(overrides: str, predicted: float, measured: float, **kw: object) -> dict:
        return _row([overrides], predicted, returncode=0, oom=False, max_memory_reserved=2**30, measured_s=measured, **kw)

    ordered = [ran(str(i), float(i), 1.0 + 0.5 * i) for i in range(ORDERED_PLANS)]
    planned = {"lora": [{"budget": "24GiB", "rows": ordered}]}
    judge(planned)
    assert planned["lora"][0]["all_fit"] and planned["lora"][0]["ordered_plans"] == ORDERED_PLANS and check(planned)
    # a plan whose reserved peak passed its budget does not fit; one not run leaves the budget unjudged as fitting
    over = {"lora": [{"budget": "1GiB", "rows": [*ordered[:-1], dict(ordered[-1], max_memory_reserved=2**30 + 1)]}]}
    judge(over)
    assert not over["lora"][0]["all_fit"] and not check(over)
    unrun = {"lora": [{"budget": "24GiB", "rows": [*ordered, _row(["x"], 9.0)]}]}
    judge(unrun)
    assert not unrun["lora"][0]["all_fit"] and not check(unrun)
    # too few plans ordered anywhere; a pair measured the other way round by more than 10%
    few = {"lora": [{"budget": "24GiB", "rows": ordered[:-1]}]}
    judge(few)
    assert few["lora"][0]["all_fit"] and not check(few)
    swapped = {"lora": [{"budget": "24GiB", "rows": [*ordered[:-1], dict(ordered[-1], measured_s=0.5)]}]}
    judge(swapped)
    assert swapped["lora"][0]["misordered"] and not check(swapped)


@pytest.mark.timeout(400)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_dry_run_plans_runs_each_distinct_plan_once_and_writes_as_it_goes(tmp_path) -> None:  # noqa: ANN001
    # tiny SFT at 80 and 120 MiB, two plans each: 4 x 4 is chosen at both and runs once, under 80 MiB (measured
    # 2026-12-01: 4 x 4 and 2 x 8 at 80 MiB, 8 x 2 and 4 x 4 at 120 MiB; 3 runs of 7-8 s each)
    code = main(["--dry-run", "--cases", "full", "--budgets", "80MiB,120MiB", "--plans", "2", "--steps", "2",
                 "--out", str(tmp_path)])
    report = json.loads((tmp_path / "plan_cuda_dry_run.json").read_text())
    assert code == 1 and report["passed"] is False  # two plans a budget: fewer than the must-show's four ordered
    budgets = report["cases"]["full"]
    runs = {r["budget_run"] + " " + " ".join(r["overrides"]) for b in budgets for r in b["rows"]}
    shared = [r for r in budgets[1]["rows"] if r["overrides"] in [q["overrides"] for q in budgets[0]["rows"]]]
    assert shared and all(r["budget_run"] == "80MiB" for r in shared)
    assert len(runs) == len({tuple(r["overrides"]) for b in budgets for r in b["rows"]}) == 3
    for b in budgets:
        assert b["all_fit"] and b["runs"] == 2 and not b["misordered"]
        assert all(r["returncode"] == 0 and not r["oom"] and r["measured_s"] > 0 for r in b["rows"])
    assert "Must show met: False" in (tmp_path / "plan_cuda_dry_run.md").read_text()
    # with no time left no run starts; what was planned is still written, each plan "not run"
    assert main(["--dry-run", "--cases", "full", "--budgets", "80MiB", "--plans", "1", "--deadline", "1",
                 "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "plan_cuda_dry_run.json").read_text())
    assert report["cases"]["full"][0]["runs"] == 0 and "| not run |" in (tmp_path / "plan_cuda_dry_run.md").read_text()


def test_an_unknown_case_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--dry-run", "--cases", "ful"])
    assert "unknown case ful: choose from full, lora" in capsys.readouterr().err

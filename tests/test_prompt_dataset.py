"""``data=prompt_dataset``: a user's RL prompts (formats, renames, eval splits, chat rendering, left padding, reward
columns), the answer verifiers (``exact``, ``math_verify`` in its worker process with a time limit), a user's
``module.reward_fn``, one-line errors for bad input, and short grpo / intuitor runs through the CLI."""

from __future__ import annotations

import csv
import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _user_assets import problems, prompt_answer_rows, write_jsonl, write_parquet

from lit_memopt import cli
from lit_memopt.data.prompt_dataset import PromptDatasetDataModule
from lit_memopt.rewards.verifiers import (
    MathVerifier,
    MissingExtraError,
    call_reward_fn,
    exact_match,
    final_answer,
    load_reward_fn,
    make_verifier,
)

REPO = Path(__file__).resolve().parent.parent
TEXT_COLUMN = "__prompt_text"  # the rendered prompt texts of the tokenized tables


@pytest.fixture(scope="module")
def tokenizer(user_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(user_checkpoint)


def _rows(count: int = 12) -> list[dict]:
    return [dict(row, level=i % 3) for i, row in enumerate(prompt_answer_rows(count))]


def _message_rows(count: int = 6) -> list[dict]:
    return [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}], "solution": a}
            for q, a in problems(count)]


def _module(tokenizer, tmp_path: Path, path, **kwargs) -> PromptDatasetDataModule:
    kwargs.setdefault("max_prompt_length", 64)
    dm = PromptDatasetDataModule(tokenizer, path=str(path), cache_dir=str(tmp_path / "cache"), **kwargs)
    dm.setup("fit")
    return dm


# ----------------------------------------------------------------------------- the datamodule
def test_text_prompts_left_padded_with_answers_and_reward_columns(tokenizer, tmp_path: Path) -> None:
    rows = _rows(8)
    dm = _module(tokenizer, tmp_path, write_jsonl(tmp_path / "p.jsonl", rows), batch_size=4, checker=exact_match)
    assert dm.train_set.cache_files, "tokenized rows are a memory-mapped Arrow table, not Python lists"
    batch = next(iter(dm._loader(dm.train_set, shuffle=False)))
    assert set(batch) == {"input_ids", "attention_mask", "prompts", "answers", "reward_kwargs"}
    assert batch["prompts"] == [r["prompt"] for r in rows[:4]] and batch["answers"] == [r["answer"] for r in rows[:4]]
    assert batch["reward_kwargs"] == {"level": [r["level"] for r in rows[:4]]}
    width = batch["input_ids"].shape[1]
    for i, prompt in enumerate(batch["prompts"]):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]  # no special tokens of the tokenizer's own
        assert width == max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in batch["prompts"])
        assert batch["input_ids"][i, width - len(ids):].tolist() == ids  # right-aligned: left padding
        assert batch["attention_mask"][i].tolist() == [0] * (width - len(ids)) + [1] * len(ids)
        assert (batch["input_ids"][i, : width - len(ids)] == tokenizer.pad_token_id).all()
    assert dm.checker is exact_match and dm.val_dataloader() == []


def test_message_prompts_rendered_with_the_generation_prompt(tokenizer, tmp_path: Path) -> None:
    rows = _message_rows(4)
    dm = _module(tokenizer, tmp_path, write_jsonl(tmp_path / "m.jsonl", rows), batch_size=2)
    batch = next(iter(dm._loader(dm.train_set, shuffle=False)))
    expected = tokenizer.apply_chat_template(rows[0]["prompt"], tokenize=False, add_generation_prompt=True)
    assert batch["prompts"][0] == expected and expected.endswith("<|im_start|>assistant\n")
    ids = tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # the template's own markers, as tokens
    assert batch["input_ids"][0, -len(ids):].tolist() == ids
    # `solution` is the gold answer, and reaches reward functions under its own name too
    assert batch["answers"] == [rows[0]["solution"], rows[1]["solution"]]
    assert batch["reward_kwargs"] == {"solution": batch["answers"]}


def _save_to_disk(tmp_path: Path, rows: list[dict], as_dict: bool) -> tuple[str, dict]:
    import datasets

    dataset = datasets.Dataset.from_list(rows)
    folder = tmp_path / "saved"
    (datasets.DatasetDict({"train": dataset}) if as_dict else dataset).save_to_disk(str(folder))
    return str(folder), {}


def _csv(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "p.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.mark.parametrize("layout", ["jsonl", "parquet", "csv", "builder", "folder", "save_to_disk", "save_to_disk_dict"])
def test_every_source_layout_loads(tokenizer, tmp_path: Path, layout: str) -> None:
    rows = prompt_answer_rows(6)
    kwargs: dict = {}
    if layout == "jsonl":
        path = write_jsonl(tmp_path / "p.jsonl", rows)
    elif layout == "parquet":
        path = write_parquet(tmp_path / "p.parquet", rows)
    elif layout == "csv":
        path = _csv(tmp_path, rows)
    elif layout == "builder":
        path, kwargs = "json", {"data_files": str(write_jsonl(tmp_path / "p.jsonl", rows))}
    elif layout == "folder":
        write_jsonl(tmp_path / "folder" / "part.jsonl", rows)
        path = tmp_path / "folder"
    else:
        path, kwargs = _save_to_disk(tmp_path, rows, as_dict=layout == "save_to_disk_dict")
    dm = _module(tokenizer, tmp_path, path, batch_size=6, **kwargs)
    batch = next(iter(dm._loader(dm.train_set, shuffle=False)))
    assert sorted(batch["prompts"]) == sorted(r["prompt"] for r in rows)
    assert sorted(batch["answers"]) == sorted(str(r["answer"]) for r in rows)


def test_columns_are_renamed_and_unknown_keys_refused(tokenizer, tmp_path: Path) -> None:
    rows = [{"question": q, "gold": a, "source": "unit"} for q, a in problems(4)]
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    dm = _module(tokenizer, tmp_path, path, columns={"question": "prompt", "gold": "answer"}, batch_size=4)
    batch = next(iter(dm._loader(dm.train_set, shuffle=False)))
    assert batch["answers"] == [r["gold"] for r in rows] and batch["reward_kwargs"] == {"source": ["unit"] * 4}
    # the synthetic default data's keys (set by the RL recipes) are ignored; anything else is named
    PromptDatasetDataModule(tokenizer, path=str(path), columns={"question": "prompt"}, task="strings")
    with pytest.raises(ValueError, match="data=prompt_dataset has no key max_prompt_lenght"):
        PromptDatasetDataModule(tokenizer, path=str(path), max_prompt_lenght=3)


def test_eval_split_and_eval_fraction(tokenizer, tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", prompt_answer_rows(10, seed=1))
    test = write_jsonl(tmp_path / "test.jsonl", prompt_answer_rows(3, seed=2))
    dm = _module(tokenizer, tmp_path, "json", data_files={"train": str(train), "test": str(test)}, eval_split="test")
    assert (len(dm.train_set), len(dm.val_set)) == (10, 3)
    assert next(iter(dm.val_dataloader()))["prompts"][0] == prompt_answer_rows(3, seed=2)[0]["prompt"]

    rows = [{"prompt": f"Copy {word}.", "answer": word} for word in ("ab", "cd", "ef", "ba", "dc", "fe", "abc", "cde", "efa", "bad")]
    path = write_jsonl(tmp_path / "all.jsonl", rows)
    first = _module(tokenizer, tmp_path, path, eval_fraction=0.3, seed=5)
    held_out = set(first.val_set[TEXT_COLUMN])
    assert len(first.train_set) == 7 and len(held_out) == 3 and not held_out & set(first.train_set[TEXT_COLUMN])
    assert set(_module(tokenizer, tmp_path, path, eval_fraction=0.3, seed=5).val_set[TEXT_COLUMN]) == held_out
    with pytest.raises(ValueError, match="not both"):
        _module(tokenizer, tmp_path, "json", data_files={"train": str(train), "test": str(test)}, eval_split="test",
                eval_fraction=0.2)
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"question": r["prompt"], "gold": r["answer"]} for r in rows])
    both = _module(tokenizer, tmp_path, renamed, columns={"question": "prompt", "gold": "answer"}, eval_fraction=0.3, seed=5)
    assert set(both.val_set[TEXT_COLUMN]) == held_out  # a fraction is cut from the renamed rows



def test_overlong_prompts_error_or_drop(tokenizer, tmp_path: Path) -> None:
    rows = prompt_answer_rows(6)
    rows[2]["prompt"] = rows[2]["prompt"] * 30
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(ValueError, match=r"1 of 6 train prompts are longer than data.max_prompt_length=64.*data.overlong=drop"):
        _module(tokenizer, tmp_path, path)
    dm = _module(tokenizer, tmp_path, path, overlong="drop")
    assert dm.report["train"] == {"rows": 6, "overlong": 1, "kept": 5} and len(dm.train_set) == 5


def test_no_answers_batches_without_answers_and_checks_name_the_columns(tokenizer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "noans.jsonl", [{"prompt": q, "topic": "math"} for q, _ in problems(4)])
    dm = _module(tokenizer, tmp_path, path, batch_size=2)
    batch = next(iter(dm.train_dataloader()))
    assert "answers" not in batch and batch["reward_kwargs"] == {"topic": ["math", "math"]}
    with pytest.raises(ValueError, match=r"columns are \[prompt, topic\].*`answer` \(or `solution`\)"):
        dm.check_answers("grpo")
    with pytest.raises(ValueError, match="data.require_answers=true needs a gold answer"):
        PromptDatasetDataModule(tokenizer, path=str(path), require_answers=True)
    with pytest.raises(ValueError, match="module.warm_start"):
        dm.warm_start_examples(2, 0)


def test_warm_start_examples_come_from_training_rows_with_answers(tokenizer, tmp_path: Path) -> None:
    rows = prompt_answer_rows(10)
    for row in rows[::2]:
        row["answer"] = None
    dm = _module(tokenizer, tmp_path, write_jsonl(tmp_path / "p.jsonl", rows), eval_fraction=0.2)
    pairs = dm.warm_start_examples(16, seed=3)
    with_answers = {(r["prompt"], r["answer"]) for r in rows if r["answer"] is not None}
    assert len(pairs) == 16 and set(pairs) <= with_answers
    assert not {p for p, _ in pairs} & set(dm.val_set[TEXT_COLUMN])  # never the held-out prompts
    assert pairs == dm.warm_start_examples(16, seed=3)


# ----------------------------------------------------------------------------- verifiers
def test_exact_verifier_compares_the_final_answer() -> None:
    assert final_answer("I think 12.\nAnswer: 19\nanything after") == "19"
    assert final_answer("so it is \\boxed{\\frac{1}{2}} and done") == "\\frac{1}{2}"
    assert final_answer("  42 \n") == "42"
    assert exact_match("work... Answer: 19", " 19 ") == 1.0
    assert exact_match("\\boxed{2} then \\boxed{3}", "3") == 1.0
    assert exact_match("Answer: 19", "20") == 0.0
    assert exact_match("", "") == 0.0 and exact_match("x", None) == 0.0  # no gold answer never matches
    assert make_verifier("exact") is exact_match and make_verifier(None) is None
    with pytest.raises(ValueError, match=r"data.verifier='regex'.*\['math_verify', 'exact'\]"):
        make_verifier("regex")


@pytest.fixture(scope="module")
def math_verifier():
    verifier = make_verifier("math_verify", 20.0)
    yield verifier
    verifier.close()


def test_math_verify_checks_equivalence_from_any_thread(math_verifier) -> None:
    assert isinstance(math_verifier, MathVerifier)
    assert math_verifier("so the answer is $0.5$", "\\frac{1}{2}") == 1.0
    assert math_verifier("We get \\boxed{2}.", "2") == 1.0
    assert math_verifier("We get \\boxed{3}.", "2") == 0.0
    assert math_verifier("anything", None) == 0.0
    results: list[float] = []
    # math-verify's own limits use signal.alarm, which fails outside the main thread; the worker process does not
    thread = threading.Thread(target=lambda: results.append(math_verifier("\\boxed{\\frac{2}{4}}", "0.5")))
    thread.start()
    thread.join(60)
    assert results == [1.0]


SLOW_SCORE = '''
import time

def score(response, answer):
    if response == "slow":
        time.sleep(120)
    return float(response == answer)
'''


def test_a_slow_answer_scores_zero_and_its_worker_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "slow_score_for_test.py").write_text(SLOW_SCORE)
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned worker inherits sys.path
    from slow_score_for_test import score

    verifier = MathVerifier(timeout_s=1.0, score_fn=score)
    try:
        assert verifier("2", "2") == 1.0
        first = verifier._worker.process
        results: list[float] = []

        def from_a_thread() -> None:
            results.append(verifier("slow", "2"))

        started = time.perf_counter()
        with pytest.warns(UserWarning, match="data.verifier_timeout=1"):
            thread = threading.Thread(target=from_a_thread)
            thread.start()
            thread.join(60)
        assert results == [0.0] and time.perf_counter() - started < 30
        assert not first.is_alive() and verifier.timeouts == 1
        assert verifier("3", "3") == 1.0 and verifier._worker.process.pid != first.pid
    finally:
        verifier.close()
    assert verifier._worker is None


def test_missing_math_verify_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(MissingExtraError, match=r"pip install 'lit-memopt\[data\]'"):
        make_verifier("math_verify")


# ----------------------------------------------------------------------------- reward functions
REWARD_CALLS: list[dict] = []


def recording_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """A user's reward function (TRL's signature): records what it was given."""
    REWARD_CALLS.append({"prompts": prompts, "completions": completions, **kwargs})
    return [float(i % 2) for i in range(len(completions))]


def test_reward_fn_is_loaded_by_dotted_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_reward_fn("test_prompt_dataset:recording_reward") is recording_reward
    assert load_reward_fn("test_prompt_dataset.recording_reward") is recording_reward
    assert load_reward_fn("os.path:join") is __import__("os").path.join
    for spec, reason in (("nowhere_xyz:fn", "cannot import 'nowhere_xyz'"), ("test_prompt_dataset:nope", "has no 'nope'"),
                         ("test_prompt_dataset:REPO", "not a function"), ("justaname", "not a dotted path")):
        with pytest.raises(ValueError, match=f"module.reward_fn=.*{reason}"):
            load_reward_fn(spec)
    # a module in the working directory, as `lit-memopt` (the console script) runs without it on sys.path
    (tmp_path / "cwd_reward_xyz.py").write_text("def fn(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert load_reward_fn("cwd_reward_xyz:fn")(prompts=["p"], completions=["a", "b"]) == [1.0, 1.0]


def test_call_reward_fn_repeats_columns_per_sample() -> None:
    REWARD_CALLS.clear()
    rewards = call_reward_fn(recording_reward, ["p1", "p2"], ["a", "b", "c", "d"], 2, answers=["1", "2"],
                             columns={"level": [0, 7]})
    assert rewards == [0.0, 1.0, 0.0, 1.0]
    assert REWARD_CALLS[0] == {"prompts": ["p1", "p1", "p2", "p2"], "completions": ["a", "b", "c", "d"],
                               "answer": ["1", "1", "2", "2"], "level": [0, 0, 7, 7]}
    with pytest.raises(ValueError, match="returned 1 rewards for 2 completions"):
        call_reward_fn(lambda prompts, completions, **kw: [1.0], ["p"], ["a", "b"], 2)


@pytest.mark.filterwarnings("ignore:.*self.trainer. reference is not registered")
def test_intuitor_rewards_with_the_reward_fn(user_checkpoint, tokenizer, tmp_path: Path) -> None:
    from lit_memopt.models import ModelConfig
    from lit_memopt.modules import IntuitorModule

    with pytest.raises(ValueError, match="module.reward_fn='no_such_module_xyz:f'"):
        IntuitorModule(ModelConfig(name="user", pretrained=str(user_checkpoint)), tokenizer,
                       reward_fn="no_such_module_xyz:f")
    rows = _rows(4)
    dm = _module(tokenizer, tmp_path, write_jsonl(tmp_path / "p.jsonl", rows), batch_size=2, checker=exact_match)
    module = IntuitorModule(ModelConfig(name="user", pretrained=str(user_checkpoint)), tokenizer, num_samples=2,
                            max_new_tokens=4, accuracy_weight=1.0, kl_coef=0.0,
                            reward_fn="test_prompt_dataset:recording_reward")
    module.checker = dm.checker
    batch = next(iter(dm._loader(dm.train_set, shuffle=False)))
    REWARD_CALLS.clear()
    loss = module.training_step(batch, 0)
    assert torch.isfinite(loss)
    (call,) = REWARD_CALLS
    assert call["prompts"] == [rows[0]["prompt"]] * 2 + [rows[1]["prompt"]] * 2
    assert call["answer"] == [rows[0]["answer"]] * 2 + [rows[1]["answer"]] * 2
    assert call["level"] == [rows[0]["level"]] * 2 + [rows[1]["level"]] * 2
    assert len(call["completions"]) == 4 and all(isinstance(c, str) for c in call["completions"])
    accuracy, external = module._rewards(batch, module._rollout(batch, 2, seed=0))
    assert external.tolist() == [0.0, 1.0, 0.0, 1.0] and accuracy is not None  # accuracy is still measured


# ----------------------------------------------------------------------------- bad input through the CLI
def _fit_error(capsys: pytest.CaptureFixture[str], tmp_path: Path, *overrides: str) -> str:
    """Run ``lit-memopt fit`` in this process; return its one-line error."""
    args = ["fit", "recipe=grpo", "data=prompt_dataset", "data.verifier=exact", "data.max_prompt_length=64",
            f"data.cache_dir={tmp_path / 'cache'}", "module.num_samples=2", "module.max_new_tokens=4",
            "trainer.max_steps=1", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        cli.main(args)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("lit-memopt: error:")]
    assert len(lines) == 1, err[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before any training
    return lines[0]


def _bad_input_cases() -> list:
    """``(name, overrides(ckpt, tmp_path), expected texts)``; ``{ckpt}`` is the user's checkpoint override."""
    good = lambda tmp: write_jsonl(tmp / "good.jsonl", prompt_answer_rows(6))  # noqa: E731
    return [
        ("missing_file", lambda tmp: [f"data.path={tmp / 'missing.jsonl'}"], ["missing.jsonl", "never downloads"]),
        ("hub_name", lambda tmp: ["data.path=someone/gsm8k"], ["someone/gsm8k", "never downloads datasets"]),
        ("no_format", lambda tmp: [f"data.path={write_jsonl(tmp / 'q.jsonl', [{'question': 'q', 'gold': 'a'}])}"],
         ["[question, gold] fit no prompt format", "`prompt`", "`solution`", "data.columns="]),
        ("empty_split", lambda tmp: [f"data.path={write_jsonl(tmp / 'empty.jsonl', [])}"], ["empty"]),
        ("grpo_without_answers",
         lambda tmp: [f"data.path={write_jsonl(tmp / 'noans.jsonl', [{'prompt': 'What is 1+1?', 'level': 1}])}"],
         ["module.accuracy_weight=1.0", "[prompt, level]", "`answer`", "module.reward_fn"]),
        ("overlong_prompt",
         lambda tmp: [f"data.path={write_jsonl(tmp / 'long.jsonl', [{'prompt': 'What is 1+1? ' * 40, 'answer': '2'}])}"],
         ["1 of 1 train prompts are longer than data.max_prompt_length=64", "data.overlong=drop"]),
        ("budget_over_positions", lambda tmp: [f"data.path={good(tmp)}", "module.max_new_tokens=250"],
         ["the longest prompt (", "+ module.max_new_tokens=250 exceeds", "max_position_embeddings=256"]),
        ("unknown_verifier", lambda tmp: [f"data.path={good(tmp)}", "data.verifier=regex"],
         ["data.verifier='regex'", "math_verify"]),
        ("bad_reward_fn", lambda tmp: [f"data.path={good(tmp)}", "module.reward_fn=no_such_module_xyz:fn"],
         ["module.reward_fn="]),
        ("rename_of_a_missing_column", lambda tmp: [f"data.path={good(tmp)}", "data.columns={nope: prompt}"],
         ["renames ['nope']", "prompt, answer"]),
    ]


@pytest.mark.parametrize("name,overrides,expected", _bad_input_cases(), ids=[c[0] for c in _bad_input_cases()])
def test_bad_input_fails_in_one_line_before_training(user_checkpoint, tmp_path: Path, capsys, name, overrides,
                                                      expected) -> None:
    line = _fit_error(capsys, tmp_path, f"model.pretrained={user_checkpoint}", *overrides(tmp_path))
    for text in expected:
        assert text in line, line


@pytest.mark.parametrize("prompts,expected", [("text", ["character tokenizer cannot encode", "model.pretrained"]),
                                              ("messages", ["no chat template", "model.tokenizer"])])
def test_the_recipes_toy_model_cannot_read_a_users_prompts(tmp_path: Path, capsys, prompts, expected) -> None:
    """The grpo recipe's character-level toy model knows neither the text's characters nor a chat template."""
    rows = prompt_answer_rows(4) if prompts == "text" else _message_rows(2)
    line = _fit_error(capsys, tmp_path, f"data.path={write_jsonl(tmp_path / 'p.jsonl', rows)}")
    for text in expected:
        assert text in line, line


# ----------------------------------------------------------------------------- short runs through the CLI
def _run_cli(args: list[str], cwd: Path, timeout: int = 300):
    import os
    import subprocess

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "lit_memopt", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _metrics(run_dir: Path) -> list[dict]:
    return list(csv.DictReader(next(run_dir.glob("logs/version_*/metrics.csv")).open()))


def _tiny_run(user_checkpoint, tmp_path: Path, recipe: str, path: Path, *overrides: str) -> list[dict]:
    run_dir = tmp_path / "run"
    result = _run_cli(
        ["fit", f"recipe={recipe}", f"model.pretrained={user_checkpoint}", "data=prompt_dataset", f"data.path={path}",
         "data.eval_fraction=0.25", "data.max_prompt_length=64", "data.batch_size=2", f"data.cache_dir={tmp_path / 'cache'}",
         "module.num_samples=2", "module.max_new_tokens=4", "trainer.max_steps=2", "trainer.val_check_interval=2",
         "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
         f"hydra.run.dir={run_dir}", *overrides],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "val/accuracy" in result.stdout  # the run summary
    # the recipes' warm start (800 steps on the toy task) is skipped for a checkpoint, and the run says so
    assert "warm start: skipped, the policy is the checkpoint" in result.stdout + result.stderr
    assert not (run_dir / "warm_start.pt").exists()
    return _metrics(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_grpo_on_a_users_checkpoint_and_prompts(user_checkpoint, tmp_path: Path) -> None:
    """The math_verify checker gives grpo's reward and val/accuracy (its worker process in a real run)."""
    rows = _rows(12)
    metrics = _tiny_run(user_checkpoint, tmp_path, "grpo", write_jsonl(tmp_path / "p.jsonl", rows))
    accuracy = [float(r["val/accuracy"]) for r in metrics if r.get("val/accuracy")]
    assert len(accuracy) == 2 and all(0.0 <= a <= 1.0 for a in accuracy)  # before the first step, and at step 2
    assert sum(1 for r in metrics if r.get("train/accuracy")) == 2


REWARD_MODULE = '''
import json

def reward(prompts, completions, **kwargs):
    with open("reward_calls.jsonl", "a") as handle:
        handle.write(json.dumps({"prompts": prompts, "completions": completions, "kwargs": kwargs}) + "\\n")
    return [float(len(c)) for c in completions]
'''


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_intuitor_on_chat_prompts_with_a_reward_fn(user_checkpoint, tmp_path: Path) -> None:
    """Chat-message prompts from parquet, `solution` answers, and a reward function from the working directory."""
    (tmp_path / "user_reward.py").write_text(REWARD_MODULE)
    path = write_parquet(tmp_path / "m.parquet", _message_rows(8))
    metrics = _tiny_run(user_checkpoint, tmp_path, "intuitor", path, "module.accuracy_weight=0.5",
                        "module.reward_fn=user_reward:reward")
    assert sum(1 for r in metrics if r.get("val/accuracy")) == 2
    assert sum(1 for r in metrics if r.get("train/reward_fn")) == 2
    calls = [json.loads(line) for line in (tmp_path / "reward_calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2
    for call in calls:
        assert len(call["completions"]) == 4 and call["prompts"][0] == call["prompts"][1]
        assert call["prompts"][0].endswith("<|im_start|>assistant\n")
        assert call["kwargs"]["answer"] == call["kwargs"]["solution"] and len(call["kwargs"]["answer"]) == 4


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_grade_logs_the_verifiers_accuracy_of_its_hard_tokens(user_checkpoint, tmp_path: Path) -> None:
    """GRADE on a user's checkpoint and prompts: its reward stays the reward model's; val/accuracy is the checker's."""
    run_dir = tmp_path / "run"
    result = _run_cli(
        ["fit", "recipe=grade", f"model.pretrained={user_checkpoint}", "data=prompt_dataset",
         f"data.path={write_jsonl(tmp_path / 'p.jsonl', _rows(12))}", "data.eval_fraction=0.25", "data.batch_size=2",
         "data.verifier=exact", f"data.cache_dir={tmp_path / 'cache'}", "module.max_new_tokens=4", "trainer.max_steps=2",
         "trainer.log_every_n_steps=1", "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false",
         f"hydra.run.dir={run_dir}"],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    accuracy = [float(r["val/accuracy"]) for r in _metrics(run_dir) if r.get("val/accuracy")]
    assert accuracy and all(0.0 <= a <= 1.0 for a in accuracy)
    assert any(r.get("train/reward") for r in _metrics(run_dir))

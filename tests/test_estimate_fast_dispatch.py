"""The estimator's fast fake-tensor dispatch gives torch's numbers: the lean dispatch-cache key, the cache hits the
tracker (and the worst-case value follower) read without dispatching again, ``out=`` calls answered with their ``out``
tensor and ``.device`` reads answered by the tracker change no output, op by op and whole estimate by whole estimate."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Callable

import pytest
import torch

from lit_memopt._compat import torch as compat_torch
from lit_memopt.cli import compose_config
from lit_memopt.cli_estimate import estimate_recipe
from lit_memopt.memory import fake as fake_module
from lit_memopt.memory import tracker as tracker_module
from lit_memopt.memory import worst_case as worst_case_module

_CHILD = "LIT_MEMOPT_FAST_DISPATCH_CHILD"


def _ops(x: torch.Tensor, w: torch.Tensor, real: torch.Tensor, other: torch.Tensor) -> list[Any]:
    """Calls that exercise what a cache key must tell apart (scalar types, strides, offsets, views, in-place, out=),
    and inputs that are not the mode's fakes: a real tensor (a LoRA adapter) and another fake mode's (a deep copy)."""
    out = torch.empty(4, 5)
    return [
        x + 1, x + 1.0, x + True, x * 2, x.t() + 1, x.t().contiguous() + 1, x[:, 1:] * 2, x[1:].sum(), x.view(24),
        x[1:].view(18), x[:3].view(18), x[:3].clone().view(18), x[1:].t() * 1, x[:3].t() * 1,
        x.reshape(6, 4), x[:, ::2], x.unsqueeze(0).expand(3, 4, 6), torch.full((3,), 1), torch.full((3,), 1.0),
        torch.zeros(2, 3, dtype=torch.bfloat16), x.to(torch.bfloat16), x.double().sum(0), torch.mm(x, w, out=out),
        torch.mm(x, w, out=out), torch.mm(x, w), x.clone().add_(1), x.topk(2, dim=-1), x.max(dim=0), torch.cat([x, x], 1),
        x.new_ones(2), torch.where(x > 0, x, 0.0), x.softmax(-1), x.requires_grad_(False).sum(),
        x @ real, torch.nn.functional.linear(x, real.t()), x @ other, torch.nn.functional.linear(x, other.t()), x + real.t()[0],
        real.t(), real.t(), real[1:].t(), other.t(), torch.zeros_like(real), real.to(torch.bfloat16), real * 2,
        torch.ops.aten._unsafe_view.default(x + 1, [24]), torch.ops.aten._unsafe_view.default(x + 1, [3, 8]),
        torch.matmul(x.unsqueeze(0).expand(2, 4, 6), w), torch.nn.functional.linear(x.unsqueeze(0), w.t()),
    ]


def _described(outputs: list[Any], inputs: list[torch.Tensor]) -> list[Any]:
    """Shapes, strides, dtypes, devices, storage sizes, and which storages are shared (numbered in order of first
    appearance, inputs first): views of an input, or of the copy the fake mode made of a real input, alike."""
    numbers: dict[int, int] = {}

    def number(t: torch.Tensor) -> int:
        return numbers.setdefault(compat_torch.storage_key(t.untyped_storage()), len(numbers))

    for t in inputs:
        number(t)

    def one(t: Any) -> Any:
        if isinstance(t, (tuple, list)):
            return tuple(one(u) for u in t)
        if not isinstance(t, torch.Tensor):
            return t
        return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, str(t.device), t.untyped_storage().nbytes(),
                number(t), type(t).__name__)

    return [one(o) for o in outputs]


def _run_ops(mode: Any, above: Callable[[Any], Any] | None = None) -> tuple[list[Any], int]:
    hits = compat_torch.FakeTensorMode.cache_hits
    real = torch.randn(6, 5)
    with compat_torch.FakeTensorMode():
        other = torch.randn(6, 5)
    with mode:
        x, w = torch.randn(4, 6), torch.randn(6, 5)
        if above is None:
            outputs = [_ops(x, w, real, other) for _ in range(2)]
        else:
            with above(mode):
                outputs = [_ops(x, w, real, other) for _ in range(2)]
        described = _described([*outputs[0], *outputs[1]], [x, w])
    return described, compat_torch.FakeTensorMode.cache_hits - hits


class _Above(compat_torch.TorchDispatchMode):
    """A mode right above the fake one that answers through ``fake_dispatch`` (as the memory tracker does)."""

    def __init__(self, mode: Any) -> None:
        super().__init__()
        self.fake = mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return compat_torch.fake_dispatch(self.fake, func, args, kwargs or {})


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_lean_key_and_cache_reads_give_torchs_outputs() -> None:
    stock, _ = _run_ops(compat_torch.FakeTensorMode(allow_non_fake_inputs=True))
    lean, _ = _run_ops(compat_torch.FastFakeTensorMode(allow_non_fake_inputs=True))
    read, hits = _run_ops(compat_torch.FastFakeTensorMode(allow_non_fake_inputs=True), _Above)
    assert lean == stock and read == stock
    assert hits > 20, "the second round is read from the fake mode's cache"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_out_call_seen_before_returns_its_out_tensor() -> None:
    mode = compat_torch.FastFakeTensorMode()
    with mode:
        a, b, out = torch.randn(4, 5), torch.randn(5, 6), torch.empty(4, 6)
        with _Above(mode):
            first, second = torch.mm(a, b, out=out), torch.mm(a, b, out=out)
            resized = torch.mm(a, b, out=torch.empty(0))  # resized by the call: never answered without it
        assert first is out and second is out and out._version == 2
        assert tuple(resized.shape) == (4, 6)


def _stock_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Estimate through torch's own fake mode and dispatch: no lean key, no cache reads, no `.device` answers."""

    def dispatch(mode: Any, func: Any, args: Any, kwargs: Any) -> Any:
        return func(*args, **kwargs)

    class Never:  # no tensor's type is this: the tracker's `.device` answer never applies
        pass

    monkeypatch.setattr(compat_torch, "FastFakeTensorMode", compat_torch.FakeTensorMode)  # what cli_estimate builds
    monkeypatch.setattr(fake_module, "FastFakeTensorMode", compat_torch.FakeTensorMode)
    monkeypatch.setattr(tracker_module, "fake_dispatch", dispatch)
    monkeypatch.setattr(worst_case_module, "fake_dispatch", dispatch)
    monkeypatch.setattr(tracker_module, "FakeTensor", Never)


def _report(overrides: list[str]) -> dict[str, Any]:
    out = estimate_recipe(compose_config(overrides)).as_dict()
    for key in ("build_seconds", "cpu_seconds"):
        out.pop(key)
    out["estimate"].pop("seconds")
    return out


def _in_a_fresh_interpreter(request: pytest.FixtureRequest) -> bool:
    """Run the test in a child pytest process (``False`` inside it): the worst-case value follower replays ops on
    real values next to fake tensors, which tests/test_estimate_worst_case.py keeps out of the shared process too."""
    if os.environ.get(_CHILD) == "1":
        return False
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
        env={**os.environ, _CHILD: "1"}, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return True


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("recipe", ["grade", "intuitor"])
def test_whole_estimates_equal_those_of_torchs_dispatch(recipe: str, monkeypatch: pytest.MonkeyPatch,
                                                        request: pytest.FixtureRequest) -> None:
    """Block extrapolation with its check (traces in a forked copy), worst-case generation, the allocator model and the
    batch search: every number of the report, fast dispatch against torch's."""
    if recipe == "intuitor" and _in_a_fresh_interpreter(request):
        return
    overrides = [f"recipe={recipe}", "module.max_new_tokens=4", "gpu_memory=32MiB"]
    fast = _report(overrides)
    _stock_dispatch(monkeypatch)
    compat_torch.FakeTensorMode.cache_clear()
    assert _report(overrides) == fast


def test_a_deep_copy_of_fakes_stays_in_their_mode_and_takes_no_storage_weak_reference_twice() -> None:
    """A frozen reference deep-copied from a fake policy: torch's copy of a fake copies its mode, and with it the
    converter's ``StorageWeakRef`` keys without a weak reference of their own; each storage's weak count is then
    released twice, which crashed a plan's teardown (use after free). Our mode is not copied."""
    import copy
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    from lit_memopt.memory.fake import fake_mode

    def duplicated_weak_refs() -> int:
        refs = [o.cdata for o in gc.get_objects() if isinstance(o, StorageWeakRef)]
        return len(refs) - len(set(refs))

    before = duplicated_weak_refs()
    with fake_mode(allow_non_fake_inputs=True) as mode:
        model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
        model[1].weight = model[0].weight  # tied head
        scale = torch.tensor(2.0) * 3  # constant propagation: a constant fake, its real storage keyed weakly
    assert scale.constant is not None and mode.fake_tensor_converter.constant_storage_mapping
    reference = copy.deepcopy(model).requires_grad_(False)
    assert reference[0].weight.fake_mode is mode and reference[0].weight is not model[0].weight
    assert reference[1].weight is reference[0].weight and model[0].weight.requires_grad
    assert duplicated_weak_refs() == before
    with mode:  # the copy is used as the policy's own fakes
        assert (reference[1](reference[0](torch.zeros(2, 3, dtype=torch.long)))).shape == (2, 3, 50)


def test_adopt_fakes_remakes_another_modes_fakes_in_the_models_mode_keeping_ties() -> None:
    from lit_memopt.memory.fake import adopt_fakes, fake_mode

    with fake_mode(allow_non_fake_inputs=True) as mode:
        model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
    with fake_mode(allow_non_fake_inputs=True) as other:  # another build (with_fake_weights makes a mode per build)
        reference = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
        reference[1].weight = reference[0].weight  # tied head
        reference.register_buffer("scale", torch.ones(3, 2).t())
    reference.requires_grad_(False)
    assert reference[0].weight.fake_mode is other
    holder = torch.nn.ModuleDict({"policy": model, "reference": reference})
    assert adopt_fakes(holder, mode) == 2  # the tied weight once, the buffer
    assert reference[1].weight is reference[0].weight and isinstance(reference[0].weight, torch.nn.Parameter)
    assert reference[0].weight.fake_mode is mode and not reference[0].weight.requires_grad
    assert reference.scale.fake_mode is mode and reference.scale.stride() == (1, 2) and "scale" in dict(reference.named_buffers())
    assert model[0].weight.requires_grad and adopt_fakes(holder, mode) == 0
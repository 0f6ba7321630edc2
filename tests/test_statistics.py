"""Tensor statistics on spans: each value equals torch's own computation on the same tensor, named after where the
tensor sits in the output (or input); tracing never changes what the model computes, and remove() leaves no hook."""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import gc
import importlib.metadata
import json
import math
import resource
import subprocess
import sys
import warnings
from array import array
from itertools import chain
from typing import Any, NamedTuple
from unittest import mock

import numpy as np
import pytest
import torch
from extras import has_c_compiler
from hypothesis import given, settings
from hypothesis import strategies as st
from instrumented import traced_modules
from torch import nn

import torchtrace
from torchtrace._capture import stats as _stats
from torchtrace._capture import summaries as _summaries
from torchtrace._capture.recorder import OUTPUTS
from torchtrace._capture.stats import StatComputer
from torchtrace._handle import _live_handles
from torchtrace._pipeline import dispatcher as _dispatch
from torchtrace._pipeline.dispatcher import resolve_forward
from torchtrace._pipeline.worker import WORKER
from torchtrace.testing import capture_spans

NUMERIC = ("mean", "std", "min", "max", "abs_max", "norm", "nan_count", "inf_count", "zero_fraction")


class Emit(nn.Module):
    """Returns whatever it is told to, so a test controls the exact output a span summarises."""

    def __init__(self, value: Any = None) -> None:
        super().__init__()
        self.value = value

    def forward(self, *args, **kwargs):
        return self.value


def output_attributes(value: Any, **options: Any) -> dict[str, Any]:
    """The torchtrace.output.* attributes of the span of a module that returns ``value``, prefix stripped."""
    module = Emit(value)
    with capture_spans(module, **options) as captured:
        module()
        attributes = dict(captured.span("Emit").attributes)
    prefix = "torchtrace.output."
    return {key.removeprefix(prefix): value for key, value in attributes.items() if key.startswith(prefix)}


def torch_stats(tensor: torch.Tensor) -> dict[str, Any]:
    """What torch itself says, in float64: magnitudes for complex tensors, values as floats for int/bool."""
    x = tensor.detach()
    x = x.abs().double() if x.is_complex() else x.double()
    n = x.numel()
    return {
        "shape": tuple(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "device": str(tensor.device),
        "mean": x.mean().item(),
        "std": torch.std(x, correction=1 if n > 1 else 0).item(),  # 0 for one finite element
        "min": x.min().item(),
        "max": x.max().item(),
        "abs_max": x.abs().max().item(),
        "norm": torch.linalg.vector_norm(x).item(),
        "nan_count": int(torch.isnan(x).sum()),
        "inf_count": int(torch.isinf(x).sum()),
        "zero_fraction": (x == 0).double().mean().item(),
    }


def assert_stats_match(got: dict[str, Any], tensor: torch.Tensor, prefix: str = "", rel: float = 1e-5) -> None:
    expected = torch_stats(tensor)
    for name, value in expected.items():
        key = f"{prefix}{name}"
        assert key in got, f"{key} missing from {sorted(got)}"
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, rel=rel, abs=1e-6, nan_ok=True), f"{key}: {got[key]} != {value}"
        else:  # the counts are ints, not floats that compare equal
            assert got[key] == value and type(got[key]) is type(value), f"{key}: {got[key]!r} != {value!r}"


# -- every statistic equals torch's computation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "rel"),
    [(torch.float32, 1e-5), (torch.float64, 1e-9), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)],
)
def test_float_statistics_equal_torch(dtype, rel, passes):
    torch.manual_seed(0)
    tensor = (torch.randn(4, 5, 6) * 3 + 1).to(dtype)
    tensor[0, 0, :3] = 0
    assert_stats_match(output_attributes(tensor), tensor, rel=rel)


@pytest.fixture(params=["native-copy", "ctypes-memmove"])
def staging_copy(request, monkeypatch):
    """Small tensors copied into their staging rows by ``torchtrace._native.copy``, and by ctypes (without it)."""
    if request.param == "native-copy" and _stats._copy is ctypes.memmove:
        pytest.skip("torchtrace._native is not built here")
    if request.param == "ctypes-memmove":
        monkeypatch.setattr(_stats, "_copy", ctypes.memmove)
    return request.param


def test_small_tensors_of_one_size_reduced_together_each_equal_torch(staging_copy, passes):
    """A forward's small tensors of one size are reduced in one batch: each row still gets torch's values, including
    a row whose mean carries nearly all of its sum of squares (the exact second pass), NaN and Inf rows, a row of
    zeros of both signs, and float64 data."""
    torch.manual_seed(4)
    rows = {
        "random": torch.randn(64) * 3 + 1,
        "relu": torch.relu(torch.randn(64)),
        "large-mean": (torch.tensor([1e8, 1e8 + 1e-3, 1e8 - 1e-3, 1e8], dtype=torch.float64)).repeat(16),
        "nan": torch.where(torch.arange(64) == 5, float("nan"), torch.randn(64)),
        "inf": torch.where(torch.arange(64) == 7, float("inf"), torch.randn(64)),
        "zeros": torch.cat([torch.zeros(32), torch.full((32,), -0.0)]),
        "tiny-spread": torch.randn(64).double() * 1e-6 + 1000,
    }
    got = output_attributes(rows)
    for name, tensor in rows.items():
        rel = 1e-9 if tensor.dtype == torch.float64 else 1e-5
        assert_stats_match(got, tensor, prefix=f"{name}.", rel=rel)


def test_more_small_tensors_of_one_size_than_the_first_rows_hold_each_equal_torch_forward_after_forward(staging_copy):
    """Small float tensors are copied into rows kept between forwards (grown when a forward has more): every call
    gets its own tensor's values, and a later forward's values never mix with an earlier one's."""
    emits = nn.ModuleList(Emit() for _ in range(40))

    class Many(nn.Module):
        def forward(self) -> None:
            for emit in emits:
                emit()

    model = Many()
    model.emits = emits
    with capture_spans(model) as captured:
        for seed in (5, 6):
            torch.manual_seed(seed)
            for i, emit in enumerate(emits):
                emit.value = torch.randn(48, dtype=torch.float64 if i == 39 else torch.float32) * (i + 1)
            model()
            for i, emit in enumerate(emits):
                span = captured.spans_named(f"emits.{i}")[-1]
                got = {key.removeprefix("torchtrace.output."): value for key, value in span.attributes.items()}
                assert_stats_match(got, emit.value, rel=1e-9 if i == 39 else 1e-5)


def test_a_small_cpu_tensor_of_a_kind_staged_before_is_copied_into_its_row_in_c():
    """``_native.stats_taken`` takes StatComputer's path for a plain CPU tensor of a kind seen before: its values
    copied into the next row of the kind's staging, its stats a copy of the kind's head naming that row, the
    tensor remembered as the latest one summarised. Wherever that path does not apply it changes nothing and
    returns None: the Python path decides (a new kind, a view with gaps, a lazy negation, a full staging, which
    Python grows)."""
    native = pytest.importorskip("torchtrace._native", reason="the compiled extension is not built here")
    computer = _stats.StatComputer(torchtrace.STAT_NAMES, {})
    first = torch.randn(4, 8)
    assert native.stats_taken(computer, first) is None  # no kind staged yet
    computer(first)  # the Python path stages the kind
    ((head, staging),) = computer._staged.values()
    second = torch.randn(4, 8)
    stats = native.stats_taken(computer, second)
    assert stats == {**head, "_row": 1} and staging.count == 2 and staging.filled[-1] is stats
    assert np.array_equal(staging.values[1], second.numpy().reshape(-1))
    assert native.stats_taken(computer, second) is stats  # unchanged since: the same stats, nothing copied
    assert staging.count == 2
    declined = [torch.randn(8, 4).t(), torch.randn(4, 8)._neg_view(), torch.randn(4, 9)]
    assert [native.stats_taken(computer, tensor) for tensor in declined] == [None, None, None]
    staging.count = len(staging.values)  # full: Python grows it
    assert native.stats_taken(computer, torch.randn(4, 8)) is None and staging.count == len(staging.values)


def test_a_forwards_small_tensors_are_staged_without_the_python_statistics_path_after_its_first(monkeypatch):
    """After a model's first forward, its small CPU outputs are copied into their rows by the compiled path; the
    statistics still equal torch's."""
    added = []
    add = _stats._Staging.add
    monkeypatch.setattr(_stats._Staging, "add", lambda self, tensor, stats: added.append(1) or add(self, tensor, stats))
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with capture_spans(model) as captured:
        model(torch.randn(3, 4))
        first = len(added)
        x = torch.randn(3, 4)
        model(x)
        spans = {span.name: span for span in captured.spans()[-4:]}
    assert first == 2 and len(added) == first  # the two kinds' first tensors (the ReLU's output: the first kind)
    hidden = model[0](x)
    for name, tensor in (("0", hidden), ("1", torch.relu(hidden)), ("2", model(x))):
        got = {key.removeprefix("torchtrace.output."): value for key, value in spans[name].attributes.items()}
        assert_stats_match(got, tensor, rel=1e-5)


def test_a_forwards_small_tensors_whose_reduction_fails_say_so_and_keep_shape_dtype_and_device(monkeypatch):
    """The small tensors of a forward are reduced together when it ends: if that fails, each of their calls gets the
    error as its ``stats_error`` and keeps what the hook read itself; the next forward is summarised again."""
    emits = nn.ModuleList(Emit(torch.randn(16) + i) for i in range(8))
    model = nn.Sequential(*emits)  # each Emit ignores its input
    reduce, compiled = _stats._stat_rows, _stats._table_rows

    def fails(*args):
        raise MemoryError("no room for the rows")

    with capture_spans(model) as captured:
        monkeypatch.setattr(_stats, "_stat_rows", fails)
        if compiled is not None:  # the one compiled call of a forward's rows of one size
            monkeypatch.setattr(_stats, "_table_rows", fails)
        model(torch.zeros(1))
        monkeypatch.setattr(_stats, "_stat_rows", reduce)
        monkeypatch.setattr(_stats, "_table_rows", compiled)
        model(torch.zeros(1))
        failed, summarised = captured.spans_named("3")
    assert failed.attributes["torchtrace.output.stats_error"] == "MemoryError: no room for the rows"
    assert failed.attributes["torchtrace.output.shape"] == (16,) and "torchtrace.output.mean" not in failed.attributes
    got = {key.removeprefix("torchtrace.output."): value for key, value in summarised.attributes.items()}
    assert_stats_match(got, emits[3].value)


class Emitted(torch.Tensor):
    """A tensor subclass: its memory is not read as a plain tensor's."""


def test_tensors_of_a_kind_seen_before_in_another_layout_each_equal_torch_forward_after_forward(staging_copy):
    """Once a kind of tensor (dtype, shape) has been copied as a plain contiguous tensor, the next of that kind is
    copied without deciding again: one of the same kind that is a view, a negative view or a subclass still gets its
    own values, in the same forward and in the next."""
    torch.manual_seed(7)
    makes = [
        lambda: torch.randn(4, 6),
        lambda: torch.randn(6, 4).t(),
        lambda: torch._neg_view(torch.randn(4, 6)),
        lambda: torch.randn(4, 6).as_subclass(Emitted),
        lambda: torch.randn(4, 6, dtype=torch.float64),
        lambda: torch.randn(4, 6),
    ]
    emits = nn.ModuleList(Emit() for _ in makes)
    model = nn.Sequential(*emits)
    with capture_spans(model) as captured:
        for _ in range(2):
            for emit, make in zip(emits, makes):
                emit.value = make()
            model(None)
            for i, emit in enumerate(emits):
                span = captured.spans_named(str(i))[-1]
                got = {key.removeprefix("torchtrace.output."): value for key, value in span.attributes.items()}
                expected = emit.value.as_subclass(torch.Tensor) if isinstance(emit.value, Emitted) else emit.value
                assert_stats_match(got, expected, rel=1e-9 if expected.dtype == torch.float64 else 1e-5)


def test_small_tensors_keep_their_values_when_a_forward_had_too_many_rows_to_keep(monkeypatch):
    """Rows kept between forwards are dropped after a forward that needed more than ``_MAX_STAGING_BYTES`` (with
    what was decided about each kind of tensor): the next forward's tensors are summarised anew."""
    monkeypatch.setattr(_stats, "_MAX_STAGING_BYTES", 256)
    emits = nn.ModuleList(Emit() for _ in range(8))
    model = nn.Sequential(*emits)
    with capture_spans(model) as captured:
        for seed in (1, 2, 3):
            torch.manual_seed(seed)
            for emit in emits:
                emit.value = torch.randn(32)
            model(None)
            for i, emit in enumerate(emits):
                span = captured.spans_named(str(i))[-1]
                got = {key.removeprefix("torchtrace.output."): value for key, value in span.attributes.items()}
                assert_stats_match(got, emit.value)


@pytest.fixture(params=["one-pass", "numpy-passes"])
def passes(request, monkeypatch):
    """CPU tensors reduced by the compiled single pass (``torchtrace._native``: a large tensor, or each row of a
    forward's small tensors of one size), and by numpy's and torch's passes: what an install without a C compiler
    runs, and what any NaN or Inf falls back to."""
    if request.param == "one-pass" and _stats._one_pass is None:
        pytest.skip("torchtrace._native is not built here")
    if request.param == "numpy-passes":
        monkeypatch.setattr(_stats, "_one_pass", None)
        monkeypatch.setattr(_stats, "_table_rows", None)
    return request.param


def test_the_one_pass_reduction_is_built_where_there_is_a_c_compiler():
    if not has_c_compiler():
        pytest.skip("no C compiler: the statistics take numpy's passes")
    try:
        importlib.metadata.distribution("torchtrace")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torchtrace is run from a checkout, not installed: nothing built it")
    assert _stats._one_pass is not None  # a failed build is optional for pip: here it would go unseen


def test_a_large_tensor_takes_the_same_values_as_torch(passes):
    torch.manual_seed(1)
    tensor = torch.randn(300, 300) * 0.01 + 5
    assert_stats_match(output_attributes(tensor), tensor, rel=1e-4)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(300, 301).t(),
        lambda: torch.randn(100_003)[3:],  # contiguous, from an offset into its storage
        lambda: torch._neg_view(torch.randn(200, 101)),
        lambda: torch.randn(50_001, dtype=torch.float64) * 1e3,
        lambda: torch.randint(-5, 5, (40_000,)),
        lambda: torch.randn(40_000) > 0.5,
        lambda: torch.randn(30_000).half(),
        lambda: torch.randn(64, 1024).relu(),  # half of it zeros
        lambda: torch.zeros(20_000),
        lambda: torch.full((20_000,), -3.0),
        lambda: torch.randn(1, 301).expand(300, 301),  # stride 0, as the gradient of a sum() loss
    ],
    ids=["transposed", "offset", "negative-view", "float64", "int64", "bool", "float16", "relu", "zeros", "constant",
         "expanded"],
)  # fmt: skip
def test_large_tensors_in_any_layout_and_dtype_equal_torch(make, passes):
    torch.manual_seed(4)
    tensor = make()
    assert_stats_match(output_attributes(tensor), tensor, rel=1e-4)


@pytest.mark.parametrize(
    "make",
    [lambda: torch.randn(300, 301).t(), lambda: torch.randn(1, 301).expand(300, 301)],
    ids=["transposed", "expanded"],
)
def test_a_strided_float_tensor_takes_the_compiled_pass_over_a_contiguous_copy(make, monkeypatch):
    """numpy's passes (several times slower) are left for NaN and Inf: a strided tensor's values are copied
    contiguous and reduced in the one compiled pass, to torch's values."""
    if _stats._one_pass is None:
        pytest.skip("torchtrace._native is not built here")

    def numpy_passes(*args: Any) -> None:
        raise AssertionError("numpy's passes taken")

    monkeypatch.setattr(_stats, "_numpy_stats", numpy_passes)
    tensor = make()
    assert_stats_match(output_attributes(tensor), tensor, rel=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(4097, 40_000),
    seed=st.integers(0, 2**16),
    scale=st.floats(1e-6, 1e6),
    shift=st.floats(-1e3, 1e3),
    zeros=st.floats(0.0, 1.0),
)
def test_property_large_float32_statistics_equal_torch_in_one_pass(n, seed, scale, shift, zeros):
    """Any length (not a multiple of the pass's lanes or blocks), spread, offset and share of zeros."""
    generator = torch.Generator().manual_seed(seed)
    tensor = torch.randn(n, generator=generator) * scale + shift
    tensor[torch.rand(n, generator=generator) < zeros] = 0.0
    assert_stats_match(output_attributes(tensor), tensor, rel=1e-4)


@pytest.mark.parametrize("scale", [1e-20, 1e-30])
def test_a_large_float32_tensor_of_tiny_values_keeps_its_exact_norm(scale, passes):
    """A vanishing gradient: float32 squares of such values flush to zero (torch's own float32 norm is 0.0 at
    1e-30); the statistics are those of the values in float64."""
    tensor = torch.randn(20_000, generator=torch.Generator().manual_seed(7)) * scale
    got = output_attributes(tensor)
    assert got["norm"] == pytest.approx(torch.linalg.vector_norm(tensor.double()).item(), rel=1e-6, abs=0)
    assert got["std"] == pytest.approx(tensor.double().std().item(), rel=1e-6, abs=0)
    assert got["mean"] == pytest.approx(tensor.double().mean().item(), rel=1e-5, abs=0)  # numpy's: a torch sum


@pytest.mark.parametrize("repeat", [1, 5000], ids=["small", "large"])
def test_float64_with_a_large_mean_and_a_tiny_spread_keeps_its_std(repeat, passes):
    tensor = torch.tensor([1e8, 1e8 + 1e-3, 1e8 - 1e-3, 1e8], dtype=torch.float64).repeat(repeat)
    got = output_attributes(tensor)
    assert got["std"] == pytest.approx(torch.std(tensor).item(), rel=1e-3)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.uint8])
def test_integer_statistics_are_those_of_the_values_as_floats(dtype, passes):
    tensor = torch.tensor([[0, 3, 7], [100, 0, 1]], dtype=dtype)
    got = output_attributes(tensor)
    assert_stats_match(got, tensor)
    assert got["mean"] == pytest.approx(111 / 6)
    assert got["zero_fraction"] == pytest.approx(2 / 6)


def test_bool_statistics_count_true_as_one(passes):
    tensor = torch.tensor([True, False, True, True])
    got = output_attributes(tensor)
    assert_stats_match(got, tensor)
    assert (got["mean"], got["max"], got["zero_fraction"]) == (0.75, 1.0, 0.25)


def test_complex_statistics_are_those_of_the_magnitude():
    tensor = torch.tensor([3 + 4j, 1j, 0j, -6 + 8j], dtype=torch.complex64)
    got = output_attributes(tensor)
    assert_stats_match(got, tensor)
    assert (got["mean"], got["max"], got["min"]) == (pytest.approx(4.0), pytest.approx(10.0), 0.0)
    assert got["dtype"] == "complex64"


def test_an_empty_tensor_has_only_shape_dtype_and_device():
    got = output_attributes(torch.empty(0, 3))
    assert got == {"shape": (0, 3), "dtype": "float32", "device": "cpu"}


def test_a_zero_dim_tensor_has_std_zero_and_an_empty_shape(passes):
    got = output_attributes(torch.tensor(-2.5))
    assert got["shape"] == ()
    numbers = {name: got[name] for name in ("mean", "std", "min", "max", "abs_max", "norm")}
    assert numbers == {"mean": -2.5, "std": 0.0, "min": -2.5, "max": -2.5, "abs_max": 2.5, "norm": 2.5}


def test_a_one_element_tensor_has_std_zero(passes):
    got = output_attributes(torch.tensor([7.0]))
    assert got["std"] == 0.0
    assert got["norm"] == 7.0


@pytest.mark.parametrize(
    "values",
    [
        [1.0, float("nan"), 3.0],
        [1.0, float("inf"), -2.0],
        [float("-inf"), 0.0, 2.0],
        [float("inf"), float("-inf"), 1.0],
        [float("nan"), float("inf"), 0.0],
    ],
    ids=["nan", "inf", "neg-inf", "both-infs", "nan-and-inf"],
)
@pytest.mark.parametrize("padding", [0, 10_000], ids=["small", "large"])
def test_non_finite_values_are_counted_and_propagate_like_torch(values, padding, passes):
    tensor = torch.cat([torch.tensor(values), torch.ones(padding)])
    got = output_attributes(tensor)
    assert_stats_match(got, tensor)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.floats(width=32, min_value=-(2.0**50), max_value=2.0**50)
        | st.sampled_from([0.0, float("nan"), float("inf"), float("-inf")]),
        min_size=1,
        max_size=40,
    )
)
def test_property_float32_statistics_equal_torch(values):
    """Through the compiled pass, and numpy's (where it is not built)."""
    tensor = torch.tensor(values, dtype=torch.float32)
    assert_stats_match(output_attributes(tensor), tensor, rel=1e-4)
    with mock.patch.object(_stats, "_one_pass", None), mock.patch.object(_stats, "_table_rows", None):
        assert_stats_match(output_attributes(tensor), tensor, rel=1e-4)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(6, 7).t(),
        lambda: torch.randn(10, 10)[::3, 1::2],
        lambda: torch._neg_view(torch.randn(5, 4)),
        lambda: torch.randn(6, 7, requires_grad=True).t() * 2,
        lambda: torch.randn(20, dtype=torch.float64, requires_grad=True) + 1,
    ],
    ids=["transposed", "strided-slice", "negative-view", "requires-grad-transposed", "float64-requires-grad"],
)
def test_small_tensors_in_any_layout_equal_torch(make, passes):
    """Small CPU tensors are copied in the hook and reduced at the forward's end: views, negative views and tensors
    that require grad give torch's values."""
    torch.manual_seed(3)
    tensor = make()
    assert_stats_match(output_attributes(tensor), tensor.detach())


def test_statistics_of_a_tensor_that_requires_grad():
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with capture_spans(layer) as captured:
        y = layer(x)
        got = captured.span("Linear").attributes
    prefixed = {key.removeprefix("torchtrace.output."): value for key, value in got.items()}
    assert_stats_match(prefixed, y)


# -- names of tensors inside outputs ------------------------------------------------------------------------------


@dataclasses.dataclass
class Prediction:
    logits: torch.Tensor
    loss: torch.Tensor | None
    label: str


class Pair(NamedTuple):
    hidden: torch.Tensor
    attention: torch.Tensor


class ModelOutput(collections.OrderedDict):
    """Like transformers.ModelOutput: an OrderedDict whose keys are also attributes."""

    def __getattr__(self, name):
        return self[name]


A = torch.tensor([1.0, 2.0, 3.0])
B = torch.tensor([[-4.0, 4.0]])
C = torch.tensor([10.0])


def means(got: dict[str, Any]) -> dict[str, float]:
    return {key.removesuffix(".mean"): value for key, value in got.items() if key.endswith(".mean") or key == "mean"}


def test_tuple_outputs_are_named_by_position():
    assert means(output_attributes((A, B))) == {"0": 2.0, "1": 0.0}


def test_nested_lists_and_tuples_are_named_by_dotted_positions():
    assert means(output_attributes([A, (B, C)])) == {"0": 2.0, "1.0": 0.0, "1.1": 10.0}


def test_dict_outputs_are_named_by_key():
    got = output_attributes({"logits": A, "hidden": B})
    assert means(got) == {"logits": 2.0, "hidden": 0.0}
    assert got["logits.shape"] == (3,)


def test_dataclass_outputs_are_named_by_field_and_skip_none_and_non_tensors():
    got = output_attributes(Prediction(logits=A, loss=None, label="cat"))
    assert means(got) == {"logits": 2.0}
    assert not any(key.startswith(("loss", "label")) for key in got)


def test_namedtuple_outputs_are_named_by_field():
    assert means(output_attributes(Pair(hidden=A, attention=B))) == {"hidden": 2.0, "attention": 0.0}


def test_model_output_like_mappings_are_named_by_key_including_nested_tuples():
    output = ModelOutput(logits=A, hidden_states=(B, C))
    got = output_attributes(output)
    assert means(got) == {"logits": 2.0, "hidden_states.0": 0.0, "hidden_states.1": 10.0}
    assert got["logits.max"] == 3.0


def test_a_none_output_has_no_statistics_and_is_not_an_error():
    module = Emit(None)
    with capture_spans(module) as captured:
        module()
        span = captured.span("Emit")
    assert not [key for key in span.attributes if key.startswith("torchtrace.output")]
    assert span.status.is_ok


def test_a_bare_tensor_output_has_no_name_segment():
    got = output_attributes(A, stats=("mean",))
    assert got == {"mean": 2.0}


# -- inputs -------------------------------------------------------------------------------------------------------


def test_inputs_are_summarised_by_position_when_inputs_is_on():
    module = Emit(C)
    with capture_spans(module, stats=torchtrace.Stats(inputs=True)) as captured:
        module(A, B)
        attributes = captured.span("Emit").attributes
    assert attributes["torchtrace.input.0.mean"] == 2.0
    assert attributes["torchtrace.input.1.min"] == -4.0
    assert attributes["torchtrace.input.1.shape"] == (1, 2)
    assert attributes["torchtrace.output.mean"] == 10.0


def test_keyword_inputs_are_summarised_by_name():
    module = Emit(C)
    with capture_spans(module, stats=torchtrace.Stats(inputs=True)) as captured:
        module(A, mask=B)
        attributes = captured.span("Emit").attributes
    assert attributes["torchtrace.input.0.mean"] == 2.0
    assert attributes["torchtrace.input.mask.max"] == 4.0


def test_inputs_are_not_summarised_by_default():
    module = Emit(C)
    with capture_spans(module) as captured:
        module(A)
        attributes = captured.span("Emit").attributes
    assert not [key for key in attributes if key.startswith("torchtrace.input")]


def test_input_statistics_equal_torch():
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    with capture_spans(layer, stats=torchtrace.Stats(inputs=True)) as captured:
        layer(x)
        got = {
            key.removeprefix("torchtrace.input.0."): value
            for key, value in captured.span("Linear").attributes.items()
            if key.startswith("torchtrace.input.0.")
        }
    assert_stats_match(got, x)


# -- choosing statistics ------------------------------------------------------------------------------------------


def test_a_stats_subset_gives_only_those_statistics():
    assert output_attributes(A, stats=("mean", "max")) == {"mean": 2.0, "max": 3.0}


def test_stats_false_gives_no_statistics():
    assert output_attributes(A, stats=False) == {}


def test_a_user_statistic_appears_next_to_the_builtin_ones():
    tensor = torch.arange(100, dtype=torch.float32)
    got = output_attributes(
        tensor, stats=torchtrace.Stats(names=("mean",), extra={"p99": lambda t: torch.quantile(t.float(), 0.99)})
    )
    assert got == {"mean": pytest.approx(49.5), "p99": pytest.approx(torch.quantile(tensor, 0.99).item())}


def test_a_raising_user_statistic_costs_only_itself():
    """The built-in statistics and the other user statistics stay; the failure is named on the span."""
    tensor = torch.arange(100, dtype=torch.float32)

    def broken(t: torch.Tensor) -> float:
        raise RuntimeError("no such quantile")

    got = output_attributes(
        tensor, stats=torchtrace.Stats(names=("mean", "max"), extra={"broken": broken, "total": lambda t: t.sum()})
    )
    assert got == {
        "mean": pytest.approx(49.5),
        "max": 99.0,
        "total": 4950.0,
        "stats_error": "broken: RuntimeError: no such quantile",
    }


def test_max_tensors_truncates_and_says_so():
    got = output_attributes((A, B, C), stats=torchtrace.Stats(names=("mean",), max_tensors=2))
    assert got == {"0.mean": 2.0, "1.mean": 0.0, "truncated": True}


def test_within_max_tensors_there_is_no_truncated_flag():
    got = output_attributes((A, B), stats=torchtrace.Stats(names=("mean",), max_tensors=2))
    assert "truncated" not in got


def test_outputs_named_like_internal_markers_are_summarised_like_any_other():
    got = output_attributes({"_error": A, "_truncated": B}, stats=("mean",))
    assert got == {"_error.mean": 2.0, "_truncated.mean": 0.0}


def test_the_std_of_huge_float32_values_does_not_overflow(passes):
    tensor = torch.tensor([1e20, -1e20] * 2500, dtype=torch.float32)  # > 4096 elements: reduced with torch passes
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no numpy overflow warning in the user's process
        got = output_attributes(tensor, stats=("std", "norm"))
    assert got["std"] == pytest.approx(float(tensor.std()), rel=1e-6)  # torch: 1.0001e20, not inf
    assert got["norm"] == float(torch.linalg.vector_norm(tensor))  # inf in float32, as torch says


def test_the_std_of_millions_of_values_far_from_zero_is_right(passes):
    """A float32 sum of millions of squares is off by ~1e-4 of itself: subtracting n * mean^2 from it leaves noise
    where the mean carries most of it (the std was off by 460x here); such data takes the exact second pass."""
    torch.manual_seed(0)
    tensor = torch.randn(4_000_000) * 0.01 + 100
    got = output_attributes(tensor, stats=("mean", "std", "norm"))
    exact = tensor.double()
    assert got["std"] == pytest.approx(float(exact.std()), rel=1e-3)
    assert got["mean"] == pytest.approx(float(exact.mean()), rel=1e-6)
    assert got["norm"] == pytest.approx(float(exact.norm()), rel=1e-3)


def test_statistics_without_std_take_no_second_pass_over_a_large_tensor(monkeypatch, passes):
    """Gradients' statistics (mean, abs_max, norm, counts) have no std: data whose mean carries its sum of squares
    costs no exact second pass for them."""
    torch.manual_seed(0)
    tensor = torch.randn(100_000) * 0.01 + 100
    exact = tensor.double()
    mean, norm, std = float(exact.mean()), float(exact.norm()), float(exact.std())
    second_passes = []  # the numpy path's exact pass is torch's vector_norm; the compiled pass says how many it took
    vector_norm = torch.linalg.vector_norm
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda *a, **k: second_passes.append(1) or vector_norm(*a, **k))
    if passes == "one-pass":
        one_pass = _stats._one_pass

        def counted(*args):
            taken = one_pass(*args)
            second_passes.extend([1] * (taken - 1))
            return taken

        monkeypatch.setattr(_stats, "_one_pass", counted)
    got = output_attributes(tensor, stats=("mean", "abs_max", "norm", "nan_count", "inf_count"))
    assert second_passes == []
    assert got["mean"] == pytest.approx(mean, rel=1e-6)
    assert got["abs_max"] == float(tensor.abs().max())
    assert got["norm"] == pytest.approx(norm, rel=1e-5)
    assert output_attributes(tensor, stats=("mean", "std"))["std"] == pytest.approx(std, rel=1e-3)
    assert second_passes == [1]  # with std: the exact pass this data needs


@pytest.mark.parametrize("elements", [12, 50_000], ids=["small", "large"])
def test_a_calls_statistics_stay_out_of_the_garbage_collectors_generations(elements):
    """Calls waiting for the worker must not be promoted towards a full collection (benchmarks/latency.py): their
    statistics hold only values the collector does not track, the shape included, once a shape has been seen."""
    summarise = StatComputer(torchtrace.STAT_NAMES, {})
    summarise(torch.randn(elements))
    summarise.finish_forward()
    gc.collect()
    stats = summarise(torch.randn(elements))
    _, _, table = summarise.finish_forward()
    if table is not None:  # a small tensor's values are a row of its forward's table
        table.fill(stats)
    assert stats["shape"] == (elements,) and "mean" in stats
    assert not gc.is_tracked(stats)


class TrackedObjects(nn.Module):
    """Counts the objects the garbage collector tracks when the forward reaches it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = len(gc.get_objects())
        return x


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_a_call_adds_no_object_for_the_collector_while_the_forward_runs(mode):
    """What a forward's calls hold until the worker takes them is promoted towards a full collection whenever a
    young collection runs meanwhile (benchmarks/latency.py): a call adds no tracked object, with statistics or
    without (the hot path writes columns of plain values)."""
    grown = {}
    for stats in (False, True):
        first, last = TrackedObjects(), TrackedObjects()
        model = nn.Sequential(first, *[nn.ReLU() for _ in range(50)], last)
        with torchtrace.instrument(model, exporter="none", stats=stats) as handle, mode():
            model(torch.randn(4))  # warm-up: shapes, dtype names and templates seen once
            handle.flush()
            gc.collect()
            gc.disable()
            try:
                with WORKER._condition:  # the worker thread holds still: only this forward's objects are counted
                    model(torch.randn(4))
            finally:
                gc.enable()
        grown[stats] = last.count - first.count
    assert grown[False] <= 3 and grown[True] <= 3, grown  # 51 calls in between


def test_resolving_a_forwards_statistics_adds_no_tracked_object_per_call():
    """The worker turns a forward's statistics into its calls' attributes, a drain of forwards at a time: what it
    makes per call must not be tracked by the collector either (a list per statistics row, alive until the drain
    is resolved, was promoted towards full collections: benchmarks/latency.py)."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(50)])
    with torchtrace.instrument(model, exporter="none") as handle:
        dispatcher = handle._dispatcher
        handle._recorder._resolve = None  # the forwards wait unresolved, for this test to resolve
        with WORKER._condition:  # the worker holds still: the forwards wait in the buffer
            for _ in range(2):
                model(torch.randn(1, 8))
            warm, forward = dispatcher.buffer.take_all()
        resolve_forward(warm, dispatcher.modules)  # attribute keys seen once
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects())
            batch = resolve_forward(forward, dispatcher.modules)
            grown = len(gc.get_objects()) - before
        finally:
            gc.enable()
    assert len(batch.attributes) == 51 and all(not gc.is_tracked(attributes) for attributes in batch.attributes)
    assert grown < 25, grown  # the batch's columns, not an object per call


@pytest.fixture(params=["compiled", "python"])
def row_values(request, monkeypatch):
    """A forward of table-row calls resolved by ``torchtrace._native.output_call_values``, and in Python by
    ``_flat_output_attributes`` (an install without a C compiler)."""
    if request.param == "compiled" and _summaries._output_call_values is None:
        pytest.skip("torchtrace._native is not built here")
    if request.param == "python":
        monkeypatch.setattr(_summaries, "_output_call_values", None)
    return request.param


def test_a_forward_whose_calls_are_all_table_rows_is_resolved_without_a_dict_per_call(row_values):
    """The usual forward with statistics (every call returns one small tensor) is resolved straight to the flat
    keys and values the records and the encoders read; a call's attributes dict is made only when asked for, and
    equals the one the per-call path makes, every statistic equal to torch's."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
    x = torch.randn(3, 8)
    with torchtrace.instrument(model, exporter="none") as handle:
        dispatcher = handle._dispatcher
        handle._recorder._resolve = None  # the forward waits unresolved, for this test to resolve
        with WORKER._condition:
            model(x)
            (forward,) = dispatcher.buffer.take_all()
        batch = resolve_forward(forward, dispatcher.modules)
        assert batch._attributes[0] is None  # nothing made yet
        counts, keys, values = batch.flat_attributes()
        assert len(counts) == 6 and len(keys) == len(values) == sum(counts)
        per_call = _summaries._attributes(forward, dispatcher.modules)
        assert batch.attributes == per_call
        assert [type(value) for value in chain.from_iterable(map(dict.values, batch.attributes))] == [
            type(value) for value in chain.from_iterable(map(dict.values, per_call))
        ]
    outputs, y = [], x
    for layer in model:
        y = layer(y)
        outputs.append(y.detach())
    for attributes, output in zip(batch.attributes[1:], outputs):
        assert attributes["torchtrace.output.mean"] == pytest.approx(output.mean().item(), rel=1e-6, abs=1e-7)
        assert attributes["torchtrace.output.max"] == output.max().item()
        assert attributes["torchtrace.output.shape"] == (3, 8)
    assert batch.attributes[0]["torchtrace.output.norm"] == pytest.approx(outputs[-1].norm().item(), rel=1e-6)


class PairAndNothing(nn.Module):
    """Calls whose outputs are a tuple (as attention's (output, weights)), nothing, one large tensor and small ones."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.quiet = nn.Identity()
        self.wide = nn.Linear(16, 5000)
        self.narrow = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attended, _ = self.attention(x, x, x)
        self.quiet(None)
        return self.wide(attended).sum() + self.narrow(attended).sum()


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_a_forward_of_tuple_outputs_and_large_tensors_is_resolved_flat_to_the_per_call_attributes(grad):
    """Outputs that are tuples or large tensors (their statistics taken in the hook, not table rows) are resolved
    straight to flat keys and values too: the calls' attributes equal the per-call path's, value types included."""
    torch.manual_seed(0)
    model = PairAndNothing()
    x = torch.randn(2, 3, 16)
    with torchtrace.instrument(model, exporter="none") as handle, torch.set_grad_enabled(grad):
        dispatcher = handle._dispatcher
        handle._recorder._resolve = None
        with WORKER._condition:
            model(x)
            (forward,) = dispatcher.buffer.take_all()
        assert forward.extras  # the attention's tuple and the quiet call's None are no single tensors
        batch = resolve_forward(forward, dispatcher.modules)
        assert batch._attributes[0] is None  # resolved flat: nothing made yet
        per_call = _summaries._attributes(forward, dispatcher.modules)
        made = batch.attributes
        for attributes, expected, call in zip(made, per_call, batch.calls(), strict=True):
            expected = expected or {"torchtrace.module.path": call.path, "torchtrace.module.type": call.type_name}
            assert attributes == expected
            assert [type(value) for value in attributes.values()] == [type(value) for value in expected.values()]
    attention = made[[call.path for call in batch.calls()].index("attention")]
    assert attention["torchtrace.output.0.shape"] == (2, 3, 16)
    wide = made[[call.path for call in batch.calls()].index("wide")]
    assert wide["torchtrace.output.shape"] == (2, 3, 5000)


def test_an_encoder_layers_forward_with_attentions_tuple_output_is_resolved_by_the_compiled_loop():
    """Attention returns (output, weights): with small tensors, every summary of the forward is a table row, named
    or not, and the compiled loop resolves it to what the Python path makes."""
    if _summaries._output_call_values is None:
        pytest.skip("torchtrace._native is not built here")
    model = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True).eval()
    with torchtrace.instrument(model, exporter="none") as handle, torch.inference_mode():
        handle._recorder._resolve = None
        with WORKER._condition:
            model(torch.randn(1, 4, 16))
            (forward,) = handle._dispatcher.buffer.take_all()
        compiled = _summaries._compiled_output_attributes(forward, handle._dispatcher.modules)
        python = _summaries._flat_output_attributes(forward, handle._dispatcher.modules)
    assert any(slots[OUTPUTS] for slots in forward.extras.values())  # the attention's tuple
    assert compiled is not None and compiled == python
    assert "torchtrace.output.0.mean" in compiled[1]


def test_a_forward_of_large_tensors_only_has_no_table_and_takes_the_compiled_loop():
    """Every output summarised in the hook (no small tensor, so no statistics table): the compiled loop reads the
    dicts' values alone, to what the Python path makes."""
    if _summaries._output_call_values is None:
        pytest.skip("torchtrace._native is not built here")
    model = nn.Sequential(nn.Linear(64, 100), nn.ReLU())
    with torchtrace.instrument(model, exporter="none") as handle, torch.inference_mode():
        handle._recorder._resolve = None
        with WORKER._condition:
            model(torch.randn(64, 64))
            (forward,) = handle._dispatcher.buffer.take_all()
        compiled = _summaries._compiled_output_attributes(forward, handle._dispatcher.modules)
        python = _summaries._flat_output_attributes(forward, handle._dispatcher.modules)
    assert forward.stat_table is None
    assert compiled is not None and compiled == python


def table_row_forward(layouts: list[tuple[str, ...] | dict[str, tuple[str, ...]]]) -> tuple[Any, list]:
    """A raw forward of len(layouts) calls of modules 0, 1, 0, 1, ..., call i's summaries as ``layouts[i]`` says: a
    tuple of stats keys for one bare tensor output, or {tensor name: stats keys} for a tuple's tensors ("" the bare
    output, {} no tensor at all). Each stats dict holds its keys, then "_row": the table's rows given out last to
    first, two columns; keys given as a list make a dict of values with no row (a large tensor's). And the modules."""
    from torchtrace._capture.recorder import ModuleInfo, RawForward

    modules = [ModuleInfo("", "Net", 0), ModuleInfo("block", "Block", 1)]
    calls = [layout if isinstance(layout, dict) else {"": layout} for layout in layouts]
    rows = sum(isinstance(keys, tuple) for summaries in calls for keys in summaries.values())
    forward = RawForward(None, 0, 0, module=[i % 2 for i in range(len(calls))], parent=[-1, *[0] * (len(calls) - 1)])
    forward.stat_table = _stats.StatTable(np.arange(2.0 * rows).reshape(rows, 2), ("mean", "nan_count"))
    for position, summaries in enumerate(calls):
        for name, keys in summaries.items():
            stats = {key: f"{key}-{position}" for key in keys}
            if isinstance(keys, tuple):
                rows -= 1
                stats["_row"] = rows
            if name:
                forward.set_extra(position, OUTPUTS, {**(forward.extra(position, OUTPUTS) or {}), name: stats})
            else:
                forward.output_stats[position] = stats
    return forward, modules


@pytest.mark.parametrize(
    "layouts",
    [
        [("shape", "dtype")] * 4,
        [("shape", "dtype"), ("shape",), ("shape",), ("dtype", "shape"), ()] * 3,
        [()],
        [("shape",), {"0": ("shape",)}, {"0": ("shape",)}, {"0": ("shape",), "1": ("shape",)}, {}, {},
         {"": ("shape",), "0": ("dtype",)}, {"1": ("shape",)}, ("shape",)],
        [("shape",), ["shape", "mean", "nan_count"], ["shape", "mean", "nan_count"], {"0": ["shape", "std"]},
         {"": ("shape",), "1": ["mean"]}, {"": ["mean"], "1": ("shape",)}, ("shape",)],
        [("shape", "dtype"), ("dtype", "shape"), ("dtype", "device"), {"0": ("shape",)}, {"1": ("shape",)},
         {"1": ("dtype",)}, ["shape", "mean"], ("shape",), ["mean", "shape"]],
    ],
    ids=["one-layout", "runs-of-layouts", "row-only", "tuples-and-nothing", "large-tensors", "same-sizes-other-keys"],
)  # fmt: skip
def test_table_row_calls_resolve_to_the_same_flat_attributes_compiled_and_in_python(layouts, monkeypatch):
    """Calls whose stats dicts differ in keys (runs of one layout, keys in another order, only the row; next to a call
    with as many keys), whose
    outputs are tuples of tensors (named summaries, with or without a bare one) or no tensor, or large tensors (a
    dict of values, no row), get the same counts,
    keys and values from the compiled loop as from the Python one (``_flat_output_attributes``, what an install
    without the compiled module takes), the counts and keys the same objects (interned: blocks are matched by
    identity); count columns stay ints."""
    if _summaries._output_call_values is None:
        pytest.skip("torchtrace._native is not built here")
    forward, modules = table_row_forward(layouts)
    compiled = _summaries._compiled_output_attributes(forward, modules)
    monkeypatch.setattr(_summaries, "_output_call_values", None)
    assert _summaries._compiled_output_attributes(forward, modules) is None
    python = _summaries._flat_output_attributes(forward, modules)
    assert compiled == python
    assert compiled[0] is python[0] and compiled[1] is python[1]
    first = compiled[0][0]  # the first call: module 0, the table's last row
    rows = forward.stat_table.values.shape[0]
    assert compiled[1][:first] == (
        "torchtrace.module.path",
        "torchtrace.module.type",
        *(f"torchtrace.output.{key}" for key in (*layouts[0], "mean", "nan_count")),
    )
    assert compiled[2][:first] == ("", "Net", *(f"{key}-0" for key in layouts[0]), 2.0 * rows - 2, 2 * rows - 1)
    assert type(compiled[2][first - 1]) is int  # a count column


@pytest.mark.parametrize(
    "odd",
    ["row-out-of-range", "row-not-int", "row-not-last", "stats-not-dict", "module-out-of-range", "float32-table",
     "strided-table", "named-not-dict", "on-a-device", "marker-name", "outputs-not-dict", "extras-not-list"],
)  # fmt: skip
def test_a_forward_not_of_table_rows_makes_the_compiled_loop_step_aside(odd):
    """The compiled loop answers None (the caller's Python path then resolves the forward) for anything but the
    form it is made for, never a wrong value or a crash."""
    from torchtrace._capture.recorder import TRUNCATED

    if _summaries._output_call_values is None:
        pytest.skip("torchtrace._native is not built here")
    forward, modules = table_row_forward([("shape",), {"0": ("shape",)}, ("shape",)])
    stats = forward.output_stats

    def made() -> Any:
        table = forward.stat_table
        return _summaries._output_call_values(
            forward.module, stats, forward.extras, OUTPUTS, *_summaries._names_of(modules), table.values,
            table.count_mask(),
        )  # fmt: skip

    assert made() is not None  # the form it is made for
    if odd == "row-out-of-range":
        stats[2]["_row"] = 3
    elif odd == "row-not-int":
        stats[2]["_row"] = 1.0
    elif odd == "row-not-last":
        stats[2] = {"_row": 1, "shape": (1,)}
    elif odd == "stats-not-dict":
        stats[2] = None
    elif odd == "float32-table":
        forward.stat_table.values = forward.stat_table.values.astype(np.float32)
    elif odd == "strided-table":
        forward.stat_table.values = np.asfortranarray(forward.stat_table.values)
    elif odd == "named-not-dict":
        forward.extra(1, OUTPUTS)["0"] = None
    elif odd == "on-a-device":  # a large tensor's statistics still in a device row
        stats[2] = {"shape": (1,), "_pending": (None, 0, 1, (), False, 1)}
    elif odd == "marker-name":
        forward.extra(1, OUTPUTS)[TRUNCATED] = {"truncated": True}
    elif odd == "outputs-not-dict":
        forward.set_extra(1, OUTPUTS, [{"_row": 0}])
    elif odd == "extras-not-list":
        forward.extras[1] = tuple(forward.extras[1])
    else:
        forward.module[1] = 7
    assert made() is None


def test_a_forwards_times_and_depths_are_the_same_compiled_and_in_python(monkeypatch):
    """``resolve_forward``'s epoch times (an open call ends at its start: native int64 columns) and depths come from
    one C loop (``_native.call_columns``) or from Python: the same values; columns that do not have the forward's
    form (a parent after its child, a time that is not an int) make the C loop step aside."""
    if _dispatch._call_columns is None:
        pytest.skip("torchtrace._native is not built here")
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Sequential(nn.Identity())), nn.Linear(4, 4))
    with torchtrace.instrument(model, exporter="none", stats=False) as handle:
        dispatcher = handle._dispatcher
        handle._recorder._resolve = None  # the forward waits unresolved, for this test to resolve
        with WORKER._condition:
            model(torch.randn(2, 4))
            (forward,) = dispatcher.buffer.take_all()
    forward.end[3] = None  # a call still open
    compiled = resolve_forward(forward, dispatcher.modules, release=False)
    monkeypatch.setattr(_dispatch, "_call_columns", None)
    python = resolve_forward(forward, dispatcher.modules, release=False)
    assert (compiled.start_ns, compiled.end_ns, compiled.depth) == (python.start_ns, python.end_ns, python.depth)
    assert compiled.depth == [0, 1, 1, 2, 2, 3, 1] and compiled.end_ns[3] == compiled.start_ns[3]
    durations = [end - start for start, end in zip(python.start_ns, python.end_ns)]  # what the summary adds up
    assert array("q", compiled.durations).tolist() == durations and python.durations is None
    from torchtrace._native import call_columns

    assert call_columns([1, 2], [3, 4], [-1, 1], 0) is None  # a call its own parent
    assert call_columns([1, 2.0], [3, 4], [-1, 0], 0) is None
    assert call_columns([1, 2], [3, 2**63], [-1, 0], 0) is None
    start_ns, end_ns, depth, durations = call_columns([1, 2], [3, 4], [-1, 0], 2**62)
    assert array("q", start_ns).tolist() == [2**62 + 1, 2**62 + 2] and depth == [0, 1]
    assert array("q", end_ns).tolist() == [2**62 + 3, 2**62 + 4]
    assert array("q", durations).tolist() == [2, 2]


def test_a_jagged_nested_tensors_ragged_dimension_is_minus_one_in_its_shape():
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
    assert output_attributes(nested, stats=("shape",)) == {"shape": (2, -1, 3)}


# -- statistics are taken when the module returns ---------------------------------------------------------------


@pytest.mark.parametrize("transform", ["vmap", "grad", "jacrev"])
@pytest.mark.parametrize("width", [8, 3000])  # a small tensor's row; a large one's pass
def test_under_torch_func_transforms_the_statistics_are_of_the_values_the_transform_computes_on(transform, width):
    """A module run inside vmap / grad / jacrev (per-sample gradients, model ensembles) returns tensors that wrap the
    values the transform computes on: those are summarised (under vmap the whole batch: the shape says so)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, width), nn.Tanh())
    x = torch.randn(3, 4)
    seen: list[torch.Tensor] = []  # the values each transform's call computes on, as torch's functorch gives them

    def unwrapped(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        while torch._C._functorch.is_functorch_wrapped_tensor(output):
            output = torch._C._functorch.get_unwrapped(output)
        seen.append(output)

    model[1].register_forward_hook(unwrapped)
    run = {
        "vmap": lambda: torch.func.vmap(model)(x),
        "grad": lambda: torch.func.grad(lambda inputs: model(inputs).sum())(x),
        "jacrev": lambda: torch.func.jacrev(model)(x[0]),
    }[transform]
    expected = run()
    with capture_spans(model) as captured:
        run()  # twice: the second call of a kind takes the staged path
        assert torch.equal(run(), expected)
    for span in captured.spans_named("1")[-2:]:
        got = {key.removeprefix("torchtrace.output."): value for key, value in span.attributes.items()}
        assert "stats_error" not in got
        assert_stats_match(got, seen[-1])
    assert tuple(seen[-1].shape) == {"vmap": (3, width), "grad": (3, width), "jacrev": (width,)}[transform]


def test_an_in_place_op_after_a_module_does_not_change_its_recorded_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True))
    x = torch.randn(32, 8)
    with torch.no_grad():
        before_relu = model[0](x)
    assert before_relu.min() < 0  # the ReLU will overwrite these in place
    with capture_spans(model) as captured, torch.no_grad():
        out = model(x)
        linear = captured.span("0").attributes
        relu = captured.span("1").attributes
    assert linear["torchtrace.output.min"] == pytest.approx(before_relu.min().item())
    assert linear["torchtrace.output.mean"] == pytest.approx(before_relu.mean().item(), rel=1e-5)
    assert relu["torchtrace.output.min"] == 0.0
    assert relu["torchtrace.output.mean"] == pytest.approx(out.mean().item(), rel=1e-5)


class ScaleChildInPlace(nn.Module):
    """Returns its child's output after scaling it in place (the child's statistics are of the values before)."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.child(x)
        out.mul_(10)
        return out


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_tensor_returned_again_unchanged_is_summarised_once_and_one_changed_in_place_again(mode):
    """A container returning its child's output shares the child's statistics (the same tensor, unchanged); a
    tensor changed in place since it was summarised gets its new values (an inference tensor, which has no version
    counter, is summarised at every level)."""
    torch.manual_seed(7)
    model = nn.Sequential(ScaleChildInPlace(), nn.Sequential(nn.Identity(), nn.Identity()))
    x = torch.randn(3, 4)
    with capture_spans(model) as captured, mode():
        out = model(x)
        child = captured.span("0.child").attributes
        scaled = captured.span("0").attributes
        passed_on = [captured.span(path).attributes for path in ("1", "1.0", "1.1", "Sequential")]
    assert child["torchtrace.output.max"] == pytest.approx(out.max().item() / 10, rel=1e-6)
    assert scaled["torchtrace.output.max"] == pytest.approx(out.max().item(), rel=1e-6)
    for attributes in passed_on:
        assert {k: v for k, v in attributes.items() if k.startswith("torchtrace.output.")} == {
            k: v for k, v in scaled.items() if k.startswith("torchtrace.output.")
        }


class ReturnsItsWeight(nn.Module):
    """Returns a parameter: made outside inference_mode, so no inference tensor even in a forward under it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight


def test_a_forward_under_inference_mode_asks_no_tensor_whether_it_is_an_inference_tensor(monkeypatch):
    """Under torch.inference_mode() every tensor a forward makes is an inference tensor: the forward's start says
    so once, not each output's binding. A tensor that is not one there (a parameter) is summarised as one: nothing
    recognised again by its version, its statistics still torch's."""
    asked = []
    is_inference = torch.Tensor.is_inference
    monkeypatch.setattr(torch.Tensor, "is_inference", lambda tensor: asked.append(1) or is_inference(tensor))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), ReturnsItsWeight(), nn.Identity())
    x = torch.randn(3, 4)
    with capture_spans(model) as captured, torch.inference_mode():
        for _ in range(3):  # kinds seen, then taken by the compiled path where it is built
            model(x)
        asked.clear()
        model(x)
        assert asked == []
        weight = captured.spans_named("2")[-1].attributes
        passed_on = captured.spans_named("3")[-1].attributes
    assert_stats_match(weight, model[2].weight.detach(), prefix="torchtrace.output.")
    assert {k: v for k, v in passed_on.items() if k.startswith("torchtrace.output.")} == {
        k: v for k, v in weight.items() if k.startswith("torchtrace.output.")
    }
    with capture_spans(model), torch.no_grad():
        asked.clear()
        model(x)
        assert asked  # outside inference_mode each output is asked: one made earlier under it may come in


def test_the_last_two_tensors_are_recognised_and_a_third_is_summarised_anew():
    summarise = StatComputer(torchtrace.STAT_NAMES, {})
    first, second, third = torch.randn(8), torch.randn(8), torch.randn(8)
    stats = [summarise(tensor) for tensor in (first, second, first, second)]
    assert stats[2] is stats[0] and stats[3] is stats[1]
    summarise(third)
    again = summarise(first)  # no longer among the last two: its own new summary, the same values
    _, _, table = summarise.finish_forward()
    assert again is not stats[0] and table.fill(again) == table.fill(stats[0])
    assert summarise(first) is not again  # a new forward forgets the tensors of the last


# -- tracing never changes the model's results ----------------------------------------------------------------------


def transformer() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4), nn.Softmax(-1))


@pytest.mark.parametrize("make_model", [transformer, mlp], ids=["transformer", "mlp"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"stats": False},
        {"stats": torchtrace.Stats(inputs=True)},
        {
            "stats": torchtrace.Stats(inputs=True),
            "records": torchtrace.Records(capture_tensors=True, module_attributes="training"),
        },
    ],
    ids=["default", "no-stats", "inputs", "everything"],
)
def test_outputs_are_bit_identical_with_and_without_tracing(make_model, options):
    model = make_model()
    torch.manual_seed(1)
    x = torch.randn(3, 5, 16) if make_model is transformer else torch.randn(7, 10)
    with torch.no_grad():
        expected = model(x)
    with capture_spans(model, **options) as captured:
        with torch.no_grad():
            traced = model(x)
        assert captured.spans_named(type(model).__name__)  # traced (not every submodule is called as a module)
    assert torch.equal(traced, expected)


def test_gradients_are_identical_with_and_without_tracing():
    model = mlp()
    x = torch.randn(7, 10)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with capture_spans(model, stats=torchtrace.Stats(inputs=True)):
        model(x).sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected, strict=True))


# -- removal ------------------------------------------------------------------------------------------------------


def test_remove_leaves_nothing_on_any_module_and_is_idempotent():
    model = transformer()
    handle = torchtrace.instrument(model, exporter="none", stats=torchtrace.Stats(inputs=True))
    assert len(traced_modules(model)) == len(list(model.modules()))  # instrumented: every module
    model(torch.randn(1, 4, 16))
    handle.remove()
    assert traced_modules(model) == []
    assert handle not in set(_live_handles)
    handle.remove()  # a second remove is a no-op
    assert traced_modules(model) == []
    recorded = len(handle.records)
    model(torch.randn(1, 4, 16))
    assert len(handle.records) == recorded  # nothing is traced after remove()


def test_the_context_manager_removes_the_hooks():
    model = mlp()
    with torchtrace.instrument(model, exporter="none") as handle:
        model(torch.randn(2, 10))
        assert len(handle.records) == len(list(model.modules()))
    assert traced_modules(model) == []
    assert handle not in set(_live_handles)


def test_the_context_manager_removes_the_hooks_when_the_body_raises():
    model = mlp()
    with pytest.raises(RuntimeError, match="user error"), torchtrace.instrument(model, exporter="none"):
        raise RuntimeError("user error")
    assert traced_modules(model) == []


def test_user_hooks_survive_remove():
    model = mlp()
    seen: list[str] = []
    user_hook = model[0].register_forward_hook(lambda module, args, output: seen.append("user"))
    with torchtrace.instrument(model, exporter="none"):
        model(torch.randn(2, 10))
    model(torch.randn(2, 10))
    assert seen == ["user", "user"]
    assert len(model[0]._forward_hooks) == 1
    user_hook.remove()


# -- sampled statistics (opt-in) ----------------------------------------------------------------------------------


def test_a_tensor_larger_than_stats_sample_is_summarised_from_an_evenly_spaced_sample():
    torch.manual_seed(0)
    tensor = torch.randn(300, 301)
    got = output_attributes(tensor, stats=torchtrace.Stats(sample=1000))
    stride = -(-tensor.numel() // 1000)  # 91: every 91st element
    sample = tensor.reshape(-1)[::stride]
    assert got["sampled"] == sample.numel() <= 1000
    assert got["shape"] == (300, 301)  # the tensor's own shape, not the sample's
    assert_stats_match({**got, "shape": tuple(sample.shape)}, sample, rel=1e-4)


def test_tensors_within_stats_sample_are_summarised_whole():
    tensor = torch.randn(10, 10)
    got = output_attributes(tensor, stats=torchtrace.Stats(sample=100))
    assert "sampled" not in got
    assert_stats_match(got, tensor)


# -- views: read in place, never materialised ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: (torch.randn(1, 1, 64, 64) * 2 + 1).expand(4, 16, 64, 64),  # an attention mask, broadcast
        lambda: torch.tensor([0.0, 1.0, float("nan"), -2.0]).expand(3, 4),  # NaN and zeros repeated
        lambda: torch.tensor([1.0, float("-inf")]).reshape(2, 1).expand(2, 5),
        lambda: torch.tensor([3.5]).expand(7),  # one value: std 0
        lambda: torch.randn(5, 1, 3, dtype=torch.float64).expand(5, 4, 3).transpose(0, 2),
    ],
    ids=["mask", "nan-and-zeros", "minus-inf", "one-value", "transposed-float64"],
)
def test_an_expanded_view_is_summarised_from_its_distinct_values_exactly(make):
    """A dimension of stride 0 repeats values: they are read once and the statistics scaled to the repeats (counts
    times the repeats, the norm and std as torch gives them over every element), equal to torch on the view."""
    tensor = make()
    assert_stats_match(output_attributes(tensor), tensor, rel=1e-5)


def test_a_huge_expanded_view_costs_no_memory():
    """``torch.zeros(1, 1).expand(2**16, 2**16)`` stands for 4G elements in 4 bytes: summarised from its one value
    (a copy would be 16 GiB inside the hook)."""
    tensor = torch.zeros(1, 1).expand(2**16, 2**16)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got = output_attributes(tensor)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100_000  # KiB: no copy was made
    assert got["shape"] == (2**16, 2**16) and "stats_error" not in got
    assert (got["mean"], got["std"], got["norm"], got["zero_fraction"], got["nan_count"]) == (0.0, 0.0, 0.0, 1.0, 0)


_PIECEWISE_SCRIPT = """
import json, resource, sys, torch, torchtrace
from torch import nn
torch.manual_seed(0)
big = torch.empty(4096, 8192, dtype=getattr(torch, sys.argv[1])).normal_(1, 2)  # 32M values: 128 MiB in float32
small = torch.randn(64, 32)
class Emit(nn.Module):
    def forward(self, which):
        return which.t()
module = Emit()
with torchtrace.instrument(module, exporter="none") as handle:
    module(small)  # everything torchtrace sets up once, before the peak is read
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    module(big)
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    handle.flush()
    attributes = handle.records[-1].attributes
    got = {k.rsplit(".", 1)[1]: v for k, v in attributes.items() if k.startswith("torchtrace.output.")}
x = big.t().double()
expected = {"mean": float(x.mean()), "std": float(x.std()), "min": float(x.min()), "max": float(x.max()),
            "norm": float(x.norm()), "zero_fraction": float((x == 0).double().mean())}
print(json.dumps({"grew_kib": grew, "got": got, "expected": expected}))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_large_strided_or_converted_tensor_is_summarised_in_pieces_of_bounded_memory(dtype):
    """A transposed activation of 32M values (128 MiB as float32; bfloat16 read through float32) is summarised piece
    by piece: the traced call's peak memory grows by a piece (8 MiB at most), not by a copy of the whole tensor,
    and every statistic equals torch's over the whole."""
    result = subprocess.run(
        [sys.executable, "-c", _PIECEWISE_SCRIPT, dtype], capture_output=True, text=True, timeout=300, check=True
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["grew_kib"] < 40 * 1024  # a whole copy: 128 MiB and more
    for name, value in report["expected"].items():
        assert report["got"][name] == pytest.approx(value, rel=1e-5), name


def test_pieces_of_a_strided_view_merge_into_torchs_statistics(monkeypatch):
    """The merge of pieces (small pieces here) against torch on views with NaN, Inf of one and of both signs,
    integers, complex values and one piece per row of a wide tensor."""
    monkeypatch.setattr(_stats, "PIECE", 1000)
    torch.manual_seed(0)
    with_nan, with_inf, with_both = torch.randn(80, 50), torch.randn(80, 50), torch.randn(80, 50)
    with_nan[3, 4] = math.nan
    with_inf[3, 4] = math.inf
    with_both[3, 4], with_both[7, 7] = math.inf, -math.inf
    for tensor in (
        torch.randn(60, 70).t() * 3 + 5,
        torch.randn(3, 50, 40).transpose(1, 2),
        torch.randn(2, 3000)[:, ::2],  # rows larger than a piece, with gaps
        (torch.randn(5000) * 2 + 1e4).to(torch.bfloat16),
        torch.arange(3000).reshape(30, 100).t(),
        torch.randn(40, 40, dtype=torch.complex64).t(),
        with_nan.t(),
        with_inf.t(),
        with_both.t(),
    ):
        got: dict[str, Any] = {"shape": tuple(tensor.shape), "dtype": str(tensor.dtype)[6:], "device": "cpu"}
        _stats.numeric_stats(tensor, _stats._ALL_NUMERIC, got)
        assert_stats_match(got, tensor, rel=1e-5)


def test_an_expanded_gradient_is_summarised_without_a_copy():
    """The gradient a ``sum()`` loss sends back is ``ones`` expanded to the output's shape: its statistics (norm
    sqrt(n), mean 1) from its one value."""
    model = nn.Sequential(nn.Linear(8, 300))
    with capture_spans(model, backward=True) as captured:
        model(torch.randn(40, 8)).sum().backward()
        captured.handle.step()
        attributes = captured.span("0 backward").attributes
    assert attributes["torchtrace.grad_output.0.norm"] == pytest.approx(math.sqrt(40 * 300))
    assert attributes["torchtrace.grad_output.0.mean"] == 1.0
    assert attributes["torchtrace.grad_output.0.nan_count"] == 0


def test_a_strided_view_is_sampled_in_place_evenly_along_each_dimension():
    """A strided (not contiguous) tensor larger than stats_sample is sampled as a view, every k-th index along its
    dimensions: no copy of the whole tensor first; the statistics are those of that sample, and say its size."""
    torch.manual_seed(0)
    tensor = torch.randn(600, 500).t()
    got = output_attributes(tensor, stats=torchtrace.Stats(sample=1000))
    sample = _stats.evenly_spaced(tensor, -(-tensor.numel() // 1000))
    assert sample.data_ptr() == tensor.data_ptr()  # a view
    assert 500 <= got["sampled"] == sample.numel() <= 2000
    assert_stats_match({**got, "shape": tuple(sample.shape)}, sample, rel=1e-4)
    expanded = torch.randn(1, 3000).expand(40, 3000)  # distinct values first, then the sample of them
    got = output_attributes(expanded, stats=torchtrace.Stats(sample=1000))
    assert got["sampled"] == 1000 * 40 and got["mean"] == pytest.approx(float(expanded[0, ::3].mean()), rel=1e-5)


def test_gradients_are_sampled_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    kept = {}

    def keep_output(module, args, output):
        output.retain_grad()
        kept["out"] = output

    model[1].register_forward_hook(keep_output)
    with capture_spans(model, backward=True, stats=torchtrace.Stats(sample=100)) as captured:
        model(torch.randn(8, 64)).pow(2).sum().backward()
        captured.handle.step()
        attributes = captured.span("1 backward").attributes
    sample = kept["out"].grad.reshape(-1)[::6]  # 512 elements, at most 100: every 6th
    assert attributes["torchtrace.grad_output.0.sampled"] == sample.numel() == 86
    assert attributes["torchtrace.grad_output.0.norm"] == pytest.approx(float(sample.norm()), rel=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.relu(torch.randn(64, 1024)),
        lambda: torch.zeros(50_000),
        lambda: torch.cat([torch.full((20_000,), -0.0), torch.tensor([float("inf"), float("-inf"), 1e-45])]),
        lambda: torch.relu(torch.randn(300, 200)).t(),
        lambda: torch.relu(torch.randn(40_000)).half(),
        lambda: torch.relu(torch.randn(40_000)).bfloat16(),
        lambda: torch.relu(torch.randn(40_000)).double(),
        lambda: torch.randint(-1, 2, (40_000,)),
    ],
    ids=["relu", "all-zero", "negative-zero-inf-denormal", "non-contiguous", "float16", "bfloat16", "float64", "int"],
)
def test_zero_fraction_of_large_tensors_equals_torch(make):
    """Large tensors count non-zeros as sign(x) . sign(x): the same count as torch's, zeros of either sign."""
    torch.manual_seed(2)
    tensor = make()
    assert_stats_match(output_attributes(tensor), tensor)


def test_large_tensors_of_one_kind_after_the_first_get_their_own_statistics(passes):
    """The first large tensor of a (dtype, shape) decides what the next ones of that kind get without the general
    path (their shape and dtype, then the compiled pass); each still gets its own values, NaN and Inf counted."""
    torch.manual_seed(0)
    finite = torch.randn(64, 128)
    with_nan = torch.randn(64, 128)
    with_nan[3, 5], with_nan[7, 9] = float("nan"), float("inf")
    module = Emit()
    with capture_spans(module) as captured:
        for value in (finite, with_nan, finite * 2):
            module.value = value
            module()
        spans = captured.spans_named("Emit")
    prefix = "torchtrace.output."
    for span, tensor in zip(spans, (finite, with_nan, finite * 2), strict=True):
        assert_stats_match(dict(span.attributes), tensor, prefix)
    assert [span.status.is_ok for span in spans] == [True, False, True]  # the NaN is found in a repeated kind too

"""Property-based tests: whatever a module returns and whatever options are passed, tracing never breaks the model.

- Any output structure (nested tuples/lists/dicts, dataclasses, named tuples, None, numbers, strings) holding any
  tensor kind (float/half/bfloat16/int/bool/complex, 0-dim, empty, sparse, meta, quantized; NaN, Inf, huge values):
  the forward returns the very same object, its tensors unchanged, no exception; every call gives one record whose
  attributes encode to OTLP.
- Real models: outputs bit-identical to the same model untraced.
- Invalid options: a clear ValueError/TypeError from instrument(), and nothing left behind (no hook, no handle).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import namedtuple
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from instrumented import traced_modules
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from torch import nn

import torchtrace
from torchtrace import STAT_NAMES, _handle
from torchtrace._otlp.protobuf import encode_export_request

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

Pair = namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Output:
    hidden: Any
    extra: Any = None


# --- tensors ------------------------------------------------------------------------------------------------------

SPECIAL = [math.nan, math.inf, -math.inf, 1e38, -1e38, 3e300, 0.0, -0.0, 1e-40]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    kind = draw(st.sampled_from(["float", "int", "bool", "complex", "zero_dim", "empty", "sparse", "meta", "quant"]))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    values = draw(st.lists(st.sampled_from(SPECIAL) | st.floats(-1e6, 1e6), min_size=1, max_size=8))
    base = torch.tensor(values, dtype=torch.float64).repeat(math.prod(shape))[: math.prod(shape)].reshape(shape)
    if kind == "float":
        return base.to(draw(st.sampled_from(FLOAT_DTYPES)))
    if kind == "int":
        return torch.nan_to_num(base, nan=0.0, posinf=2.0**62, neginf=-(2.0**62)).to(torch.int64)
    if kind == "bool":
        return base > 0
    if kind == "complex":
        return torch.complex(base.float(), base.flip(-1).float())
    if kind == "zero_dim":
        return base.reshape(-1)[0].clone().to(draw(st.sampled_from(FLOAT_DTYPES)))
    if kind == "empty":
        return torch.empty((0, *shape[1:]), dtype=draw(st.sampled_from(FLOAT_DTYPES)))
    if kind == "sparse":
        return torch.nan_to_num(base.float()).to_sparse()
    if kind == "meta":
        return torch.empty(shape, device="meta")
    clean = torch.nan_to_num(base.float(), nan=0.0, posinf=100.0, neginf=-100.0).clamp(-100, 100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated in torch, still supported
        return torch.quantize_per_tensor(clean, scale=0.5, zero_point=0, dtype=torch.qint8)


leaves = tensors() | st.none() | st.integers(-5, 5) | st.text(max_size=3) | st.floats(allow_nan=True)


def containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(st.text("abcxyz_", min_size=1, max_size=4), children, max_size=4)
        | st.builds(Output, children, children)
        | st.builds(Pair, children, children)
    )


outputs = st.recursive(leaves, containers, max_leaves=12)


class Emit(nn.Module):
    """Returns whatever it was given to return: the output structure under test."""

    def __init__(self) -> None:
        super().__init__()
        self.value: Any = None

    def forward(self, x: torch.Tensor) -> Any:
        return self.value


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emit = Emit()

    def forward(self, x: torch.Tensor) -> Any:
        return self.emit(x)


def tensor_leaves(value: Any, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 8:
        return []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensor_leaves(item, depth + 1)]
    return []


def snapshot(tensor: torch.Tensor) -> Any:
    if tensor.is_meta:
        return (tuple(tensor.shape), tensor.dtype)
    if tensor.is_quantized:
        return tensor.int_repr().clone()
    return tensor.clone()


def assert_unchanged(tensor: torch.Tensor, before: Any) -> None:
    if tensor.is_meta:
        assert (tuple(tensor.shape), tensor.dtype) == before
    elif tensor.is_quantized:
        assert torch.equal(tensor.int_repr(), before)
    else:
        torch.testing.assert_close(tensor, before, rtol=0, atol=0, equal_nan=True)


@SETTINGS
@given(value=outputs, inputs=st.booleans(), stats=st.sampled_from([True, False, ("mean", "nan_count", "shape")]))
def test_any_output_structure_is_returned_unchanged_and_recorded(value: Any, inputs: bool, stats: Any) -> None:
    model = Wrapper()
    model.emit.value = value
    leaves_before = [(t, snapshot(t)) for t in tensor_leaves(value)]
    x = torch.randn(2, 3)
    with torchtrace.instrument(model, exporter="none", stats=torchtrace.Stats(names=stats, inputs=inputs)) as handle:
        result = model(x)  # never raises
        assert result is value
        records = handle.records
    for tensor, before in leaves_before:
        assert_unchanged(tensor, before)
    assert [record.path for record in records] == ["", "emit"]
    for record in records:
        assert all(isinstance(key, str) for key in record.attributes)
    payload = encode_export_request(records, Resource({}), "torchtrace", "")
    request = ExportTraceServiceRequest.FromString(payload)  # the attributes make valid OTLP
    assert len(request.resource_spans[0].scope_spans[0].spans) == 2


@SETTINGS
@given(
    scale=st.sampled_from([1e-30, 1.0, 1e10, 1e30]),
    poison=st.sampled_from([None, math.nan, math.inf]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_traced_outputs_are_bit_identical_to_untraced(scale: float, poison: Any, dtype: torch.dtype, seed: int) -> None:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 4), nn.ReLU())).to(dtype)
    x = torch.randn(3, 8, dtype=dtype) * scale
    if poison is not None:
        x[0, 0] = poison
    expected = model(x)
    with torchtrace.instrument(model, exporter="none", stats=torchtrace.Stats(inputs=True)):
        traced = model(x)
        traced_again = model(x)
    for out in (traced, traced_again):
        assert out.dtype == expected.dtype
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))  # bit for bit, NaN payloads too


# --- invalid options ----------------------------------------------------------------------------------------------

not_a_stat = st.text(min_size=1, max_size=8).filter(
    lambda name: name not in STAT_NAMES and name.strip() == name and "," not in name and name not in ("all", "none")
)
invalid_options = st.one_of(
    st.builds(lambda v: {"include": v}, st.integers() | st.lists(st.integers(), min_size=1)),
    st.builds(lambda v: {"exclude": v}, st.lists(st.none(), min_size=1)),
    st.builds(lambda v: {"stats": [v]}, not_a_stat),
    st.builds(lambda v: {"stats": v}, st.integers() | st.floats()),
    st.builds(lambda v: {"sample_ratio": v}, st.floats(max_value=-1e-9) | st.floats(min_value=1.000001)),
    st.builds(lambda v: {"sample_ratio": v}, st.text(max_size=3)),
    st.builds(lambda v: {"sample_every": v}, st.integers(max_value=0)),
    st.builds(lambda v: {"sample_every": v}, st.floats() | st.text(max_size=3)),
    st.builds(lambda v: {"max_depth": v}, st.integers(max_value=-1)),
    st.builds(lambda v: {"stats": torchtrace.Stats(max_tensors=v)}, st.integers(max_value=0) | st.text(max_size=2)),
    st.builds(lambda v: {"limits": torchtrace.Limits(max_pending_calls=v)}, st.integers(max_value=0)),
    st.builds(
        lambda v: {"exporter": v},
        st.text(max_size=6).filter(lambda t: t.lower() not in ("auto", "otlp", "sdk", "file", "none", "")),
    ),
    st.builds(lambda v: {"types": v}, st.integers() | st.just(int) | st.just((nn.Linear, "Linear"))),
    st.builds(lambda v: {"stats": torchtrace.Stats(extra=v)}, st.just({"bad name": torch.mean}) | st.just({"ok": 3})),
    st.builds(lambda v: {"records": torchtrace.Records(function_on_output=v)}, st.integers()),
    st.builds(lambda v: {"sinks": v}, st.just([1])),
    st.builds(lambda v: {"stats": torchtrace.Stats(inputs=v)}, st.integers(2, 9) | st.text(min_size=1, max_size=3)),
    st.builds(lambda v: {v: 1}, st.sampled_from(["sample_rate", "exporters", "max_calls"])),
)


@SETTINGS
@given(options=invalid_options)
def test_invalid_options_raise_a_clear_error_at_instrument_time(options: dict) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises((ValueError, TypeError)) as raised:
        torchtrace.instrument(model, **options)
    message = str(raised.value)
    names = [*options, *(field for value in options.values() if hasattr(value, "given") for field in value.given())]
    assert any(name in message for name in names) or any(str(v) in message for v in options.values()), message
    assert traced_modules(model) == []
    assert not _handle._live_handles


@SETTINGS
@given(globs=st.lists(st.text(max_size=6), max_size=3), exclude=st.lists(st.text(max_size=6), max_size=2))
def test_any_glob_text_either_selects_modules_or_is_refused_clearly(globs: list[str], exclude: list[str]) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    x = torch.randn(1, 2)
    expected = model(x)
    try:
        handle = torchtrace.instrument(model, exporter="none", include=globs or "*", exclude=exclude)
    except ValueError as error:  # the globs match nothing: said at instrument() time, with the real paths
        assert "matches" in str(error) and "module paths look like" in str(error)
        assert traced_modules(model) == []
        return
    with handle:
        assert torch.equal(model(x), expected)
        assert {record.path for record in handle.records} <= {"", "0", "1"}

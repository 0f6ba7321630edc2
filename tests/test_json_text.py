"""``torchtrace._otlp._json_text.percent_format``: ``text % values`` in C for the conversions the OTLP/JSON
templates hold (ids, times, floats, shapes' text), a float written as ``repr`` writes it (Ryu's shortest digits in
CPython's layout), and None for anything else, so that the caller's ``%`` writes it (the same text, or the same
error)."""

from __future__ import annotations

import math
import random
import struct
import sys

import pytest

json_text = pytest.importorskip("torchtrace._otlp._json_text", reason="torchtrace._otlp._json_text is not built here")
percent_format = json_text.percent_format

EDGES = [
    0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 2.225073858507201e-308, sys.float_info.max,
    sys.float_info.min, sys.float_info.epsilon, 0.1, 0.2, 0.3, 1 / 3, 2 / 3, 0.5, 1.0, -1.0, 10.0, 100.0, 123.456,
    1e-4, 9.999999999999999e-5, 0.00011, 1e-5, 1.5e-5, 1e15, 9999999999999998.0, 1e16, 1.0000000000000002e16,
    1.2345e16, 1e17, 1e22, 1e23, 2.0**53, 2.0**53 + 2, 2.0**54, 2.0**63, 2.0**64, 2.0**-1022, 2.0**-1074, 1e100,
    1e-100, 1e300, 1e-300, 1e308, 1.7e308, 9007199254740993.0, 4.35, 0.035, 1234567890123456.7, 299792458.0,
    6.02214076e23, 1.602176634e-19,
]  # fmt: skip


def random_doubles(count: int, seed: int) -> list[float]:
    """Finite doubles from every part of the range: random bit patterns (subnormals included), whole numbers, the
    doubles of float32 values (what device statistics hold) and decimal-looking values."""
    rng = random.Random(seed)
    found: list[float] = []
    while len(found) < count:
        kind = len(found) % 4
        if kind == 0:
            value = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        elif kind == 1:
            value = float(rng.randint(-(10**18), 10**18)) / 10 ** rng.randint(0, 18)
        elif kind == 2:
            value = struct.unpack("<f", rng.getrandbits(32).to_bytes(4, "little"))[0]
        else:
            value = rng.gauss(0.0, 1.0) * 10.0 ** rng.randint(-12, 20)
        if math.isfinite(value):
            found.append(value)
    return found


@pytest.mark.parametrize("seed", range(4))
def test_floats_are_written_as_repr_writes_them(seed):
    values = random_doubles(50_000, seed) + EDGES + [-value for value in EDGES]
    template = ",".join(["%r"] * len(values))
    assert percent_format(template, tuple(values)) == template % tuple(values)


def test_every_float_between_the_layout_boundaries_is_positional_or_exponent_as_in_repr():
    """The doubles next to 1e-4 and 1e16 (where repr switches between 0.0001 and 1e-05, 1e+16 and
    9999999999999998.0), and a run of whole numbers around 2^53 (the exact path for small integers)."""
    values = []
    for boundary in (1e-4, 1e16, 2.0**53, 1.0, 10.0):
        value = boundary
        for _ in range(200):
            value = math.nextafter(value, 0.0)
        for _ in range(400):
            values.append(value)
            value = math.nextafter(value, math.inf)
    template = " ".join(["%r"] * len(values))
    assert percent_format(template, tuple(values)) == template % tuple(values)


def test_ids_and_times_are_written_as_percent_writes_them():
    cases = [
        ("%032x", 2**128 - 1), ("%032x", 0), ("%032x", 0x0123456789ABCDEF0123456789ABCDEF), ("%032x", 2**64),
        ("%016x", 2**64 - 1), ("%016x", 0), ("%016x", 0xAB), ("%d", 0), ("%d", -(2**63)), ("%d", 2**63 - 1),
        ("%d", 1_764_000_000_123_456_789),
    ]  # fmt: skip
    for conversion, value in cases:
        assert percent_format(conversion, (value,)) == conversion % value
    trace_id = 0xFEDCBA9876543210_0123456789ABCDEF  # the same object in many slots (a forward's spans)
    text = '{"traceId":"%032x","spanId":"%016x","start":"%d","mean":%r,"shape":%s,"note":"100%%"},' * 3
    shape = '{"arrayValue":{"values":[{"intValue":"8"},{"intValue":"512"}]}}'
    values = (trace_id, 1, 10, 0.5, shape, trace_id, 2, 20, -1.25, shape * 40, 0x5EED << 64, 3, 30, 1e-7, "")
    assert percent_format(text, values) == text % values


@pytest.mark.parametrize(
    ("text", "values"),
    [
        ("%032x", (2**128,)),  # past 128 bits: % writes 33 digits
        ("%032x", (-1,)),
        ("%016x", (2**64,)),
        ("%016x", (-1,)),
        ("%d", (2**63,)),
        ("%d", (1.5,)),  # % writes int(1.5)
        ("%d", (True,)),  # a bool is not an int here
        ("%r", (float("nan"),)),
        ("%r", (float("inf"),)),
        ("%r", (1,)),
        ("%r", (3.0, 4.0)),  # too many values: % raises
        ("%r %r", (3.0,)),  # too few
        ("%s", (7,)),  # text only: % writes str(7)
        ("%s", ("caf\u00e9",)),  # ASCII text only
        ("%5d", (7,)),
        ("%(key)s", ({"key": 1},)),
        ("caf\u00e9 %r", (1.0,)),  # not ASCII (the templates are: json.dumps escapes)
        ("trailing %", ()),
    ],
)
def test_anything_else_is_left_to_percent(text, values):
    assert percent_format(text, values) is None


def test_text_without_conversions_comes_back_whole():
    assert percent_format('{"a":"100%%"}', ()) == '{"a":"100%"}'
    assert percent_format("", ()) == ""

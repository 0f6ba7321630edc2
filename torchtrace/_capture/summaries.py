"""A forward's statistics as its calls' span attributes: the one reader of the stats dicts the capture leaves.

A tensor's statistics are a dict made in the hook (``stats``): its shape, dtype and device, then either its values,
or a placeholder standing for them, always the dict's last key: ``stats.ROW`` (a row of the forward's ``StatTable``,
its small CPU tensors reduced together at the forward's end; the compiled ``output_call_values`` reads the same
rule) or ``stats.PENDING`` (a reduction still on a device, resolved once read back). Here they become
``<prefix>[.<name>].<stat>`` attributes, flat (``CallBatch.set_flat_attributes``) where every call holds its outputs'
statistics alone, else a dict per call: ``set_attributes``, the one step the pipeline calls per forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from torchtrace._capture.recorder import ATTRIBUTES, INPUTS, OUTPUTS, ModuleInfo, RawForward, SummaryMarker
from torchtrace._capture.stats import PENDING, ROW, StatTable, device_table, resolve
from torchtrace._core.calls import CallBatch, interned
from torchtrace.attributes import INPUT_PREFIX, MODULE_ATTRIBUTE_PREFIX, MODULE_PATH, MODULE_TYPE, OUTPUT_PREFIX

try:
    from torchtrace._native import output_call_values as _output_call_values
except ImportError:  # not built (no C compiler at install): the Python loops make the same values
    _output_call_values = None


def set_attributes(batch: CallBatch, forward: RawForward, modules: Sequence[ModuleInfo]) -> None:
    """The forward's statistics (and module attributes) as each call's span attributes on ``batch``: flat where
    every call holds its outputs' statistics alone, by the compiled loop where it is built; else a dict per call."""
    if forward.device is not None and forward.device.rows and forward.stat_table is None:
        _tabulate_device_rows(forward)
    flat = None
    if _only_output_summaries(forward):
        flat = _compiled_output_attributes(forward, modules) or _flat_output_attributes(forward, modules)
    if flat is not None:
        batch.set_flat_attributes(*flat)
    else:
        batch.attributes = _attributes(forward, modules)


_PATH_KEY, _TYPE_KEY = MODULE_PATH, MODULE_TYPE
CALL_KEYS = (_PATH_KEY, _TYPE_KEY)  # every call's first two attributes


# (prefix, tensor name, stat keys) -> (attribute keys, the StatTable columns they end with, if a row's)
_prefixed_keys: dict[tuple, tuple[tuple[str, ...], tuple | None]] = {}


# the same for a call whose only statistics are its output's table row, its path and type keys first
_row_call_keys: dict[tuple, tuple[tuple[str, ...], tuple | None]] = {}


def _keys_of(
    cache: dict, cache_key: tuple, prefix: str, name: str, stats: dict, table: StatTable | None, head: tuple = ()
) -> tuple[str, ...]:
    """``head``, then ``<prefix>[.<name>].<stat>`` for each statistic of ``stats`` (a table row's columns in place of
    its ROW, the dict's last key); cached under ``cache_key`` with the table's columns (compared by identity)."""
    columns = table.columns if ROW in stats else None
    cached = cache.get(cache_key)
    if cached is not None and cached[1] is columns:
        return cached[0]
    if len(cache) > 10_000:  # output structures with ever-new keys: stay bounded
        cache.clear()
    base = f"{prefix}.{name}" if name else prefix
    names = [*list(stats)[:-1], *columns] if columns is not None else stats
    keys = (*head, *(f"{base}.{key}" for key in names))
    cache[cache_key] = (keys, columns)
    return keys


def _stat_attributes(
    attributes: dict, prefix: str, summaries: dict[str, dict] | None, table: StatTable | None = None
) -> None:
    keys: list[str] = []
    values: list = []
    _stat_items(keys, values, prefix, summaries, table)
    attributes.update(zip(keys, values))


def _stat_items(
    keys: list[str], values: list, prefix: str, summaries: dict[str, dict] | None, table: StatTable | None = None
) -> None:
    """Appends the attribute keys and values of each tensor's statistics (``_tensor_items``), and the own keys of a
    summary that is no tensor (truncated, a feature's error)."""
    if not summaries:
        return
    for name, stats in summaries.items():
        if isinstance(name, SummaryMarker):
            for key, value in stats.items():
                keys.append(f"{prefix}.{key}")
                values.append(value)
        else:
            _tensor_items(keys, values, prefix, name, stats, table)


def gradient_items(keys: list[str], values: list, prefix: str, summaries: dict[str, dict]) -> None:
    """``_stat_items`` of a backward span's gradient summaries, whose stats dicts are the values themselves (read on
    the host: no table row) in the usual case: their keys come straight from ``_keys_of``'s cache, without its
    layers of calls (~0.5 us a summary, two a span); anything else (a marker, statistics still on a device) takes
    ``_stat_items``."""
    for name, stats in summaries.items():
        cache_key = (prefix, name, *stats)
        cached = _prefixed_keys.get(cache_key)
        if cached is None or cached[1] is not None:  # not made yet, or made for a table row
            if type(name) is not str or PENDING in stats or ROW in stats:
                _stat_items(keys, values, prefix, {name: stats})
                continue
            keys += _keys_of(_prefixed_keys, cache_key, prefix, name, stats, None)
        else:
            keys += cached[0]
        values += stats.values()


def _tensor_attributes(attributes: dict, prefix: str, name: str, stats: dict, table: StatTable | None) -> None:
    keys: list[str] = []
    values: list = []
    _tensor_items(keys, values, prefix, name, stats, table)
    attributes.update(zip(keys, values))


def _tensor_items(keys: list[str], values: list, prefix: str, name: str, stats: dict, table: StatTable | None) -> None:
    """Appends one tensor's statistics as ``<prefix>[.<name>].<stat>`` keys and their values; the values of a tensor
    whose statistics are a row of the forward's ``table`` come from the row (its stats dict is left as it is: it may
    be shared)."""
    if PENDING in stats:
        resolve(stats)
    keys += _keys_of(_prefixed_keys, (prefix, name, *stats), prefix, name, stats, table)
    if ROW in stats:
        row = [*stats.values()]
        row[-1:] = table.row(row[-1])
        values += row
    else:
        values += stats.values()


def fill_table_rows(forward: RawForward) -> None:
    """Puts the values of every statistics row of a forward into the stats dicts naming them, for readers of the
    dicts themselves (the NaN / Inf producer's search, a training step's verdict)."""
    table = forward.stat_table
    if table is None:
        return
    for stats in _tensor_summaries(forward):
        table.fill(stats)


def _tensor_summaries(forward: RawForward) -> list[dict]:
    """Every stats dict of a forward's calls: bare tensor outputs', then the tensors of other outputs and inputs (a
    list: the compiled pass takes it as it is)."""
    found = list(forward.output_stats.values())
    for extras in forward.extras.values():
        for summaries in (extras[OUTPUTS], extras[INPUTS]):
            if summaries:
                found += summaries.values()
    return found


def _tabulate_device_rows(forward: RawForward) -> None:
    """A forward's statistics still in device rows become its table (read as a CPU forward's small tensors are),
    and it says whether any holds NaN or Inf."""
    made = device_table(_tensor_summaries(forward))
    if made is not None:
        forward.stat_table, forward.all_finite = made


def _compiled_output_attributes(
    forward: RawForward, modules: Sequence[ModuleInfo]
) -> tuple[tuple, tuple, tuple] | None:
    """``CallBatch.flat_attributes()`` of a forward whose calls hold nothing but their outputs' statistics (a bare
    tensor's, a tuple's tensors'; table rows or dicts of values), by the compiled module (the values in one C loop,
    the keys once per layout; it checks the form itself). None without it, or where a summary has another form
    (still on a device, a marker): ``_flat_output_attributes`` then builds them in Python."""
    if _output_call_values is None:
        return None
    table = forward.stat_table or _NO_TABLE
    made = _output_call_values(
        forward.module, forward.output_stats, forward.extras, OUTPUTS, *_names_of(modules), table.values,
        table.count_mask(),
    )  # fmt: skip
    if made is None:
        return None
    values, runs = made
    return (*_output_layout(runs, table), values)


_NO_TABLE = StatTable(np.empty((0, 0)), ())  # a forward with no small tensors: no row to read


# id(modules) -> (modules, their paths, their type names): the compiled loop's view of a handle's modules
_module_names: dict[int, tuple[Sequence[ModuleInfo], list[str], list[str]]] = {}


# (a forward's calls' layouts as (count, layout) runs, the table's columns) -> (counts, keys) of its calls
_output_layouts: dict[tuple, tuple[tuple, tuple]] = {}


def _names_of(modules: Sequence[ModuleInfo]) -> tuple[list[str], list[str]]:
    cached = _module_names.get(id(modules))
    if cached is None or cached[0] is not modules:
        if len(_module_names) >= 64:  # handles come and go: stay bounded
            _module_names.clear()
        cached = _module_names[id(modules)] = (
            modules, [info.path for info in modules], [info.type_name for info in modules]
        )  # fmt: skip
    return cached[1], cached[2]


def _output_layout(runs: tuple[tuple[int, tuple], ...], table: StatTable) -> tuple[tuple, tuple]:
    """(each call's number of attributes, all their keys) of a forward whose calls' layouts come in ``runs``
    ((count, ((tensor name, or None for the bare output, its stats keys), ...)): what ``_flat_output_attributes``
    gives call by call, made once per layout (interned, as ``flat_attributes``)."""
    key = (runs, table.columns)
    layout = _output_layouts.get(key)
    if layout is None:
        if len(_output_layouts) > 10_000:  # layouts that never repeat: stay bounded
            _output_layouts.clear()
        counts: list[int] = []
        keys: list[str] = []
        for count, summaries in runs:
            call_keys = [*CALL_KEYS]
            for name, stat_keys in summaries:
                name = name or ""
                call_keys += _keys_of(_prefixed_keys, (OUTPUT_PREFIX, name, *stat_keys), OUTPUT_PREFIX, name,
                                      dict.fromkeys(stat_keys), table)  # fmt: skip
            counts += [len(call_keys)] * count
            keys += call_keys * count
        layout = _output_layouts[key] = (interned(tuple(counts)), interned(tuple(keys)))
    return layout


def _row_call(info: ModuleInfo, stats: dict, table: StatTable, table_values: list, width: int) -> tuple[tuple, list]:
    """(attribute keys, values) of a call whose only statistics are its output's table row: its module path and
    type, its stats dict's values up to ROW (the dict's last key), then the row's values in that key's place."""
    keys = _keys_of(_row_call_keys, (*stats,), OUTPUT_PREFIX, "", stats, table, CALL_KEYS)
    values = [info.path, info.type_name, *stats.values()]
    first = values.pop() * width
    values += table_values[first : first + width]
    return keys, values


def _only_output_summaries(forward: RawForward) -> bool:
    """Whether the forward's attributes are its calls' outputs' statistics alone (no inputs summarised, no module
    attributes): what ``_flat_output_attributes`` builds."""
    extras = forward.extras
    if not (forward.output_stats or extras):
        return False
    return all(slots[INPUTS] is None and slots[ATTRIBUTES] is None for slots in extras.values())


def _flat_output_attributes(forward: RawForward, modules: Sequence[ModuleInfo]) -> tuple[tuple, tuple, tuple]:
    """``CallBatch.flat_attributes()`` of a forward whose calls hold nothing but their outputs' statistics (table
    rows, a large tensor's values summarised in the hook, an attention's tuple output), in Python: where the compiled
    module is not built, or a summary has a form it steps aside for. Built flat, as a step's backward spans are,
    without a dict a call (``_attributes`` makes the same attributes as dicts)."""
    all_stats, all_extras, module_of, table = forward.output_stats, forward.extras, forward.module, forward.stat_table
    counts: list[int] = []
    keys: list[str] = []
    values: list = []
    for position, index in enumerate(module_of):
        info = modules[index]
        before = len(keys)
        keys += CALL_KEYS
        values += (info.path, info.type_name)
        stats = all_stats.get(position)
        if stats is not None:  # one tensor out
            _tensor_items(keys, values, OUTPUT_PREFIX, "", stats, table)
        extras = all_extras.get(position)
        if extras is not None:  # any other output (a tuple, a dict): its tensors by name; or none
            _stat_items(keys, values, OUTPUT_PREFIX, extras[OUTPUTS], table)
        counts.append(len(keys) - before)
    return interned(tuple(counts)), interned(tuple(keys)), tuple(values)


def _attributes(forward: RawForward, modules: Sequence[ModuleInfo]) -> list[dict | None]:
    """Each call's span attributes, None for a call with only its module path and type."""
    column: list[dict | None] = [None] * len(forward.module)
    all_stats, all_extras = forward.output_stats, forward.extras
    if not all_stats and not all_extras:
        return column
    module_of = forward.module
    table = forward.stat_table
    table_values = table.values_list() if table is not None else None
    width = table.width if table is not None else 0
    for position in all_stats.keys() | all_extras.keys():
        output_stats = all_stats.get(position)
        extras = all_extras.get(position)
        outputs, inputs, attrs = (extras[OUTPUTS], extras[INPUTS], extras[ATTRIBUTES]) if extras else _NO_SUMMARIES
        if output_stats is not None and ROW in output_stats and not (outputs or inputs or attrs):
            # the usual call with statistics: one tensor out, its values a row of the forward's table
            keys, values = _row_call(modules[module_of[position]], output_stats, table, table_values, width)
            column[position] = dict(zip(keys, values))
        elif outputs or inputs or attrs or output_stats is not None:
            info = modules[module_of[position]]
            attributes: dict[str, Any] = {_PATH_KEY: info.path, _TYPE_KEY: info.type_name}
            if output_stats is not None:
                _tensor_attributes(attributes, OUTPUT_PREFIX, "", output_stats, table)
            if outputs:
                _stat_attributes(attributes, OUTPUT_PREFIX, outputs, table)
            if inputs:
                _stat_attributes(attributes, INPUT_PREFIX, inputs, table)
            if attrs:
                for name, value in attrs.items():
                    if isinstance(value, (str, bool, int, float)):
                        attributes[f"{MODULE_ATTRIBUTE_PREFIX}.{name}"] = value
            column[position] = attributes
    return column


_NO_SUMMARIES = (None, None, None)

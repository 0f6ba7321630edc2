"""A model's reference statistics for drift scoring: per traced layer and statistic, the distribution of the values
it had when the model was known good, and the model's identity, so that a baseline never scores another model.

The distribution is a quantile sketch (``SKETCH_POINTS`` evenly spaced quantiles, min and max included) with the
number of values behind it: small and fixed in size whatever the number of forwards, exact in rank terms for what
the score reads (where a new value falls among the reference values, ``Reference.rank``), and free of any
assumption about the statistic's shape (a zero fraction, an activation's maximum over a batch of discrete tokens
and a mean near 0 are all far from normal).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from torchtrace._core.files import replaced_when_complete
from torchtrace.attributes import main_output_prefix

DRIFT_STATS = ("mean", "std", "abs_max", "zero_fraction")  # of each call's main output, as the metrics' gauges
SKETCH_POINTS = 101  # quantiles 0, 1, ..., 100 %
MIN_VALUES = 20  # a layer's statistic with fewer baseline values is not scored (its reference says too little)
RELATIVE_TOLERANCE = 1e-3  # differences below this share of the layer's output scale count as none
FORMAT = "torchtrace.baseline/1"


class BaselineError(ValueError):
    """A baseline that cannot be read, or that belongs to another model."""


@dataclass(frozen=True)
class Reference:
    """One layer statistic's reference distribution: ``count`` values, summarised by ``quantiles`` (``SKETCH_POINTS``
    of them, at evenly spaced probabilities from 0 to 1)."""

    count: int
    quantiles: tuple[float, ...]

    @property
    def median(self) -> float:
        return self.quantiles[len(self.quantiles) // 2]

    def band(self, low: float = 0.05, high: float = 0.95) -> tuple[float, float]:
        """The values between these quantiles (default: the middle 90%)."""
        last = len(self.quantiles) - 1
        return self.quantiles[round(low * last)], self.quantiles[round(high * last)]


@dataclass(frozen=True)
class Baseline:
    """Reference statistics of one model: ``torchtrace baseline TRACES -o baseline.json``, ``handle.baseline()``,
    or ``Baseline.load(path)``; ``instrument(model, baseline=...)`` scores every traced call against it.

    ``model`` is the model's class name, ``parameters`` its parameter count (None when built from trace files,
    which do not carry it), ``layers`` each layer's path -> class name, ``references`` (path, statistic) -> its
    ``Reference``, ``forwards`` the number of forwards the values came from.
    """

    model: str
    parameters: int | None
    layers: Mapping[str, str]
    references: Mapping[tuple[str, str], Reference]
    forwards: int
    source: str = ""
    created: str = field(default="", compare=False)

    @property
    def fingerprint(self) -> str:
        """A short hash of the layers' paths and classes: equal for two baselines of the same architecture."""
        text = "\n".join(f"{path}\t{kind}" for path, kind in sorted(self.layers.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        where = f", source={self.source!r}" if self.source else ""
        return f"Baseline(model={self.model!r}, layers={len(self.layers)}, forwards={self.forwards}{where})"

    def tolerance(self, path: str, stat: str) -> float:
        """How far apart two values of this layer statistic must be to count as different: ``RELATIVE_TOLERANCE`` of
        the layer's output scale (its median std, or the statistic's own median where larger); of 1 for a zero
        fraction. Below it are rounding and kernel differences, not drift: a LayerNorm's mean moves by 1e-9 between
        builds and would otherwise look like a change of every value."""
        if stat == "zero_fraction":
            return RELATIVE_TOLERANCE
        own = self.references.get((path, stat))
        spread = self.references.get((path, "std"))
        scale = max(abs(own.median) if own else 0.0, abs(spread.median) if spread else 0.0)
        return RELATIVE_TOLERANCE * scale if scale > 0 else 0.0

    def check(self, model: str, parameters: int | None, layers: Mapping[str, str]) -> None:
        """Raises ``BaselineError`` unless the baseline belongs to this model: the same class, the same parameter
        count (where the baseline knows it), and each of its layers traced in the model with the same class."""
        problems = []
        if model != self.model:
            problems.append(f"it is of a {self.model}, the model is a {model}")
        if self.parameters is not None and parameters is not None and parameters != self.parameters:
            problems.append(f"it was made with {self.parameters:,} parameters, the model has {parameters:,}")
        missing = [path for path in self.layers if path and path not in layers]  # "": the model, compared above
        if missing:
            problems.append(f"{len(missing)} of its layers are not traced in the model ({_some(missing)})")
        changed = [f"{path} ({kind}, now {layers[path]})" for path, kind in self.layers.items()
                   if path and path in layers and layers[path] != kind]  # fmt: skip
        if changed:
            problems.append(f"{len(changed)} of its layers changed class ({_some(changed)})")
        if problems:
            where = f" ({self.source})" if self.source else ""
            raise BaselineError(f"this baseline{where} is not of this model: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        layers: dict[str, Any] = {}
        for path, kind in self.layers.items():
            stats = {stat: {"count": ref.count, "quantiles": list(ref.quantiles)}
                     for (p, stat), ref in self.references.items() if p == path}  # fmt: skip
            layers[path] = {"type": kind, "stats": stats}
        return {
            "format": FORMAT,
            "model": self.model,
            "parameters": self.parameters,
            "fingerprint": self.fingerprint,
            "forwards": self.forwards,
            "created": self.created,
            "layers": layers,
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Writes the baseline as JSON (replacing ``path`` only once complete)."""
        with replaced_when_complete(path) as partial:
            partial.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Baseline:
        """Reads a baseline written by ``save()`` (or ``torchtrace baseline``); ``BaselineError`` says what is wrong."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as error:
            raise BaselineError(f"cannot read the baseline {os.fspath(path)!r}: {error.strerror or error}") from None
        except ValueError as error:
            raise BaselineError(f"the baseline {os.fspath(path)!r} is not JSON: {error}") from None
        return cls.from_json(data, source=os.fspath(path))

    @classmethod
    def from_json(cls, data: Any, source: str = "") -> Baseline:
        where = f" {source!r}" if source else ""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise BaselineError(f"the file{where} is not a torchtrace baseline (format {FORMAT!r} expected)")
        try:
            layers = {str(path): str(entry["type"]) for path, entry in data["layers"].items()}
            references = {
                (str(path), str(stat)): Reference(int(ref["count"]), tuple(float(q) for q in ref["quantiles"]))
                for path, entry in data["layers"].items()
                for stat, ref in entry["stats"].items()
            }
            parameters = data.get("parameters")
            baseline = cls(str(data["model"]), None if parameters is None else int(parameters), layers, references,
                           int(data["forwards"]), source, str(data.get("created", "")))  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise BaselineError(f"the baseline{where} is damaged: {type(error).__name__}: {error}") from None
        bad = [f"{path}.{stat}" for (path, stat), ref in baseline.references.items()
               if len(ref.quantiles) != SKETCH_POINTS or list(ref.quantiles) != sorted(ref.quantiles)]  # fmt: skip
        if bad:
            raise BaselineError(f"the baseline{where} is damaged: unsorted or short quantiles at {_some(bad)}")
        return baseline


class BaselineBuilder:
    """Collects each traced forward call's main-output statistics (trace file spans or records) into a
    ``Baseline``."""

    def __init__(self) -> None:
        self.models: dict[str, int] = {}  # the root's class -> its forwards
        self.layers: dict[str, str] = {}
        self.values: dict[tuple[str, str], list[float]] = {}
        self._prefixes: dict[tuple[str, int], str] = {}

    def add(self, path: str, type_name: str, attributes: Mapping[str, Any]) -> None:
        """One forward call of a layer (``path`` "" for the model itself) and its span attributes."""
        if path == "":
            self.models[type_name] = self.models.get(type_name, 0) + 1
        self.layers.setdefault(path, type_name)
        key = (path, len(attributes))
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = self._prefixes[key] = main_output_prefix(attributes)
        for stat in DRIFT_STATS:
            value = attributes.get(f"{prefix}.{stat}")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.values.setdefault((path, stat), []).append(float(value))

    def build(self, parameters: int | None = None, source: str = "") -> Baseline:
        """The baseline of the calls added, stamped with the time it is made (UTC)."""
        if not self.models:
            raise BaselineError('no forward of a model itself (its root span, module path "") to make a baseline of')
        if len(self.models) > 1:
            named = ", ".join(f"{name} ({count} forwards)" for name, count in sorted(self.models.items()))
            raise BaselineError(f"forwards of several models: {named}; choose one")
        ((model, forwards),) = self.models.items()
        references = {key: sketch(values) for key, values in self.values.items() if len(values) >= MIN_VALUES}
        if not references:
            raise BaselineError(
                f"no layer statistic has {MIN_VALUES} values in {forwards} forwards: trace more forwards, with "
                f"statistics on (any of {', '.join(DRIFT_STATS)})"
            )
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return Baseline(model, parameters, dict(self.layers), references, forwards, source, created)


def sketch(values: Iterable[float]) -> Reference:
    """The reference distribution of ``values``: their count and ``SKETCH_POINTS`` quantiles."""
    array = np.asarray(list(values), dtype=np.float64)
    quantiles = np.quantile(array, np.linspace(0.0, 1.0, SKETCH_POINTS))
    return Reference(len(array), tuple(float(q) for q in quantiles))


def _some(items: list[str], shown: int = 3) -> str:
    more = f", and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more

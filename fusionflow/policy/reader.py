"""Walking a parsed policy config: every key and type checked, every problem a ValueError that names
the file and the key path (``configs/mine.yaml: augment.ops.Rotat: unknown op; did you mean 'Rotate'?``).
Used by schema.py (the file) and overrides.py (load_policy's keyword overrides)."""

from __future__ import annotations

import difflib
import math
from collections.abc import Hashable, Mapping
from typing import Any

import yaml

from fusionflow.policy.op_specs import OPS, OpSpec

# what to write for a required key a config often leaves out
MISSING_HINTS = {"augment": "write augment: {type: none} for no augmentation, or a type such as rand, trivial, augmix"}


class Reader:
    """Walks a parsed config, checking keys and types, and raises errors that name the key path."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, message: str):
        raise ValueError(f"{self.source}: {path or '<top level>'}: {message}")

    def mapping(self, obj: Any, path: str, required: tuple[str, ...], optional: tuple[str, ...]) -> dict:
        if not isinstance(obj, Mapping):
            self.fail(path, f"expected a mapping, got {type(obj).__name__} {obj!r}")
        allowed = required + optional
        for key in obj:
            if key not in allowed:
                hint = difflib.get_close_matches(str(key), allowed, n=1)
                fix = f"did you mean {hint[0]!r}?" if hint else f"allowed keys: {', '.join(allowed)}"
                if not allowed:  # e.g. an op without a magnitude: nothing to set
                    fix = f"{path or 'this'} takes no keys: give it as {{}}"
                self.fail(_join(path, key), f"unknown key; {fix}")
        for key in required:
            if key not in obj:
                hint = MISSING_HINTS.get(_join(path, key))
                self.fail(_join(path, key), "missing required key" + (f" ({hint})" if hint else ""))
        return dict(obj)

    def number(self, obj: Any, path: str, lo: float | None = None, hi: float | None = None) -> float:
        if isinstance(obj, bool) or not isinstance(obj, (int, float)):
            self.fail(path, f"expected a number, got {type(obj).__name__} {obj!r}{_yaml_number_hint(obj)}")
        if not math.isfinite(obj):  # NaN passes every comparison below; inf would pass an open bound
            self.fail(path, f"expected a finite number, got {obj!r}")
        if (lo is not None and obj < lo) or (hi is not None and obj > hi):
            self.fail(path, f"{obj!r} is out of range [{lo}, {hi}]")
        return float(obj)

    def integer(self, obj: Any, path: str, lo: int | None = None, hi: int | None = None) -> int:
        if isinstance(obj, bool) or not isinstance(obj, int):
            self.fail(path, f"expected an integer, got {type(obj).__name__} {obj!r}")
        if (lo is not None and obj < lo) or (hi is not None and obj > hi):
            self.fail(path, f"{obj!r} is out of range [{lo}, {hi}]")
        return obj

    def boolean(self, obj: Any, path: str) -> bool:
        if not isinstance(obj, bool):
            self.fail(path, f"expected true or false, got {type(obj).__name__} {obj!r}")
        return obj

    def choice(self, obj: Any, path: str, options: tuple[str, ...]) -> str:
        if obj not in options:
            hint = difflib.get_close_matches(str(obj), options, n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"choose one of {', '.join(options)}"
            self.fail(path, f"{obj!r} is not valid; {fix}")
        return obj

    def pair(self, obj: Any, path: str, lo=None, hi=None, ordered=True) -> tuple[float, float]:
        if not isinstance(obj, (list, tuple)) or len(obj) != 2:
            self.fail(path, f"expected a list of two numbers, got {obj!r}")
        a = self.number(obj[0], f"{path}[0]", lo, hi)
        b = self.number(obj[1], f"{path}[1]", lo, hi)
        if ordered and a > b:
            self.fail(path, f"lower bound {a} is greater than upper bound {b}")
        return (a, b)

    def triple(self, obj: Any, path: str, lo=None, hi=None) -> tuple[float, float, float]:
        if not isinstance(obj, (list, tuple)) or len(obj) != 3:
            self.fail(path, f"expected a list of three numbers (one per RGB channel), got {obj!r}")
        return tuple(self.number(v, f"{path}[{i}]", lo, hi) for i, v in enumerate(obj))

    def fill(self, obj: Any, path: str) -> tuple[int, int, int]:
        """A fill colour: one integer 0..255 for every channel, or [r, g, b] (128.0 is 128; 127.5 is refused)."""
        if isinstance(obj, (list, tuple)):
            if len(obj) != 3:
                self.fail(path, f"expected a list of three integers 0..255 (one per RGB channel), got {obj!r}")
            return tuple(self._level(v, f"{path}[{i}]") for i, v in enumerate(obj))
        return (self._level(obj, path),) * 3

    def _level(self, obj: Any, path: str) -> int:
        value = self.number(obj, path, 0, 255)
        if value != int(value):
            self.fail(path, f"expected an integer 0..255, got {obj!r}")
        return int(value)

    def subpolicy_steps(self, raw: Any, path: str, shape: str):
        """A non-empty list of sub-policies, each a non-empty list of steps: yields (sub-policy index,
        the step's path, the step) in order; `shape` names a step's form for the messages."""
        if not isinstance(raw, (list, tuple)) or not raw:
            self.fail(path, "expected a non-empty list of sub-policies")
        for i, sp in enumerate(raw):
            if not isinstance(sp, (list, tuple)) or not sp:
                self.fail(f"{path}[{i}]", f"expected a non-empty list of {shape} steps, got {sp!r}")
            for j, step in enumerate(sp):
                yield i, f"{path}[{i}][{j}]", step

    def op_name(self, obj: Any, path: str) -> OpSpec:
        if not isinstance(obj, str):
            self.fail(path, f"expected an op name, got {type(obj).__name__} {obj!r}")
        if obj not in OPS:
            hint = difflib.get_close_matches(str(obj), list(OPS), n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"registered ops: {', '.join(OPS)}"
            self.fail(path, f"unknown op {obj!r}; {fix}")
        return OPS[obj]


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader refusing a key given twice in one mapping (YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:  # the mapping's own keys ("<<: *anchor" merges may be overridden)
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # refused by the constructor below, as YAML refuses it
            if key in seen:
                mark = key_node.start_mark
                raise ValueError(
                    f"{mark.name}: line {mark.line + 1}: key {key!r} given twice (YAML keeps only the last)"
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str) -> Any:
    """A policy file parsed: a ValueError naming the file for a file that cannot be read, invalid YAML or a
    key given twice in one mapping."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_UniqueKeys)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:  # a directory, no permission, not text
        raise ValueError(f"policy file {path!r} cannot be read: {exc}") from None


def _yaml_number_hint(obj: Any) -> str:
    """YAML 1.1 (PyYAML) reads an exponent without a dot, such as 5e-1 or 1e3, as a string: say how to write it."""
    try:
        value = float(obj) if isinstance(obj, str) else math.nan
    except ValueError:
        value = math.nan
    return f" (YAML reads {obj} as text: write it with a dot, e.g. {value!r})" if math.isfinite(value) else ""

"""JSON read from files (bnsurgeon's metadata, a model directory's config.json): one reading only; and JSON written
(``dumps``): strict, one convention for non-finite floats."""

from __future__ import annotations

import json
import math
import numbers
import re
from typing import Any

from bnsurgeon.core.layout import shown


class RepeatedKeyError(ValueError):
    """A JSON object whose key repeats: parsers disagree on which value counts (Python keeps the last)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {shown(key, 100)} appears twice")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for ``json.loads``: an object whose keys repeat is ambiguous, so refused."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise RepeatedKeyError(key)
        result[key] = value
    return result


#: how a float that JSON cannot hold is written (strict JSON has no Infinity or NaN): a string that Python's
#: ``float()`` and JavaScript's ``Number()`` both read back as the same value
NON_FINITE = {float("inf"): "Infinity", float("-inf"): "-Infinity"}
NAN_TEXT = "NaN"


_SURROGATE = re.compile("[\ud800-\udfff]")


def well_formed(text: str) -> str:
    """``text`` as Unicode every JSON reader takes: a lone surrogate (a file name's undecodable byte, which
    Python keeps as U+DC80-U+DCFF) is written as its byte escaped (``\\xff``, as the messages show it) instead
    of a ``\\udcff`` escape that serde and jiter refuse and jq replaces."""
    if not _SURROGATE.search(text):
        return text
    return _SURROGATE.sub(_escaped, text)


def _escaped(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"


def strict(value: Any) -> Any:
    """``value`` with every float JSON cannot hold (inf, -inf, nan; a dict key too) written as its string
    (``NON_FINITE``, ``NAN_TEXT``); a numpy or other real number as the float or int it is (not its ``str``);
    tuples become lists. Anything else is kept for ``json.dumps`` (and its ``default``)."""
    if isinstance(value, numbers.Real) and not isinstance(value, (float, int)):  # numpy.float32, Fraction, ...
        value = int(value) if isinstance(value, numbers.Integral) else float(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else NON_FINITE.get(value, NAN_TEXT)
    if isinstance(value, str):
        return well_formed(value)
    if isinstance(value, dict):
        return {
            strict(key) if isinstance(key, (numbers.Real, str)) else key: strict(item) for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [strict(item) for item in value]
    return value


def dumps(value: Any, *, indent: int | None = None, sort_keys: bool = False, default: Any = None) -> str:
    """The one way bnsurgeon writes JSON (``--json``, the reports, a directory's config.json, metadata): strict
    JSON that jq, ``JSON.parse``, Go and serde all read, non-finite floats written as strings (``strict``)."""
    if default is not None:
        inner = default

        def default(item: Any) -> Any:  # what default makes (str of a tensor, say) is made strict too
            return strict(inner(item))

    return json.dumps(strict(value), indent=indent, sort_keys=sort_keys, default=default, allow_nan=False)


class NonFiniteConstantError(ValueError):
    """``NaN``, ``Infinity`` or ``-Infinity`` in JSON read from a file: Python's reader takes them, strict JSON has none."""

    def __init__(self, constant: str) -> None:
        super().__init__(f"{constant} is not a JSON value")
        self.constant = constant


def refuse_constant(constant: str) -> Any:
    """``parse_constant`` for ``json.loads``: a file holding NaN or Infinity is not strict JSON, so refused."""
    raise NonFiniteConstantError(constant)


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def nesting_depth(text: str) -> int:
    """How deep JSON ``text`` nests (arrays and objects), found without parsing it: a reader recurses once per level,
    so a file is measured before it is read."""
    deepest = depth = 0
    for bracket in _BRACKET.findall(_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest

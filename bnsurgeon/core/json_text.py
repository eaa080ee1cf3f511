"""JSON read from files (bnsurgeon's metadata, a model directory's config.json): one reading only."""

from __future__ import annotations

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

"""Resolve a mistyped model name: exact, then case-insensitive, then confusable characters.

``Resnet50`` is ``resnet50`` (unique up to case: accepted); ``efficientnet_bO`` (letter
O), ``resnet5O``, ``efficientnet-b0`` differ only by look-alike characters and are
suggested first; anything else gets difflib's closest names.
"""

from __future__ import annotations

import difflib
from typing import Iterable

#: characters users swap for one another; both sides of a comparison are folded the same way
CONFUSABLES = str.maketrans({"o": "0", "l": "1", "i": "1", "-": "_"})


def fold(name: str) -> str:
    """The name with case and look-alike characters erased: ``efficientnet_bO`` and ``efficientnet_b0`` fold alike."""
    return name.lower().translate(CONFUSABLES)


def case_insensitive_match(name: str, names: Iterable[str]) -> str | None:
    """The one name equal to ``name`` up to case, or None (none, or ambiguous)."""
    matches = [candidate for candidate in names if candidate.lower() == name.lower()]
    return matches[0] if len(matches) == 1 else None


def suggestions(name: str, names: Iterable[str], n: int = 3) -> list[str]:
    """Closest names: look-alike matches first, then difflib on the folded names."""
    names = list(names)
    folded: dict[str, list[str]] = {}
    for candidate in names:
        folded.setdefault(fold(candidate), []).append(candidate)
    key = fold(name)
    found = list(folded.get(key, []))
    for close in difflib.get_close_matches(key, list(folded), n=n, cutoff=0.6):
        found += [c for c in folded[close] if c not in found]
    return found[:n]

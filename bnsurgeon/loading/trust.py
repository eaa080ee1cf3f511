"""The trust rules, in one place: what in a file is data, and what the user must confirm.

A file is data. Code (a factory ``pkg.mod:fn``) runs only when the user names it, and a
name read from a file is confirmed only by the user naming exactly the same string.
Constructor arguments read from a file are plain literals, shown in the model's
description, and used only when the file's tensors check them (timm's ``num_classes``
and ``in_chans`` change the weights' shapes, so the strict load proves them) or when the
user confirms each one (the same ``--model-arg key=value``, or ``--accept-recorded-args``).
"""

from __future__ import annotations

import math
import re
from typing import Any

from bnsurgeon.core.errors import FLAG_KEYWORDS, MAX_TEXT, ConfirmationError
from bnsurgeon.core.layout import describe_kwargs, shown
from bnsurgeon.loading.architecture import Architecture, parse_architecture

#: timm model names, with an optional pretrained tag (``resnet50.a1_in1k``)
TIMM_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
#: timm constructor arguments that a strict load of the file's tensors verifies
TENSOR_CHECKED_TIMM_ARGS = frozenset({"num_classes", "in_chans"})
PLAIN_SCALARS = (str, int, float, bool, type(None))
#: constructor arguments that size a model's tensors: read from a file, each must be a size
SIZE_ARGS = frozenset({"num_classes", "in_chans", "num_features", "embed_dim", "num_heads", "img_size"})
#: sizes that may be 0 (timm's num_classes=0: no classifier)
ZERO_SIZE_ARGS = frozenset({"num_classes"})
#: no model dimension is larger (ImageNet-21k has 21,843 classes); a larger one is an allocation bomb
MAX_SIZE_ARG = 1 << 24


def is_plain_literal(value: Any, depth: int = 0) -> bool:
    """str/int/float/bool/None, and lists/tuples/dicts (string keys) of them: data, never code."""
    if depth > 8:
        return False
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, PLAIN_SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain_literal(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and is_plain_literal(item, depth + 1) for key, item in value.items())
    return False


def size_arg_problem(name: str, value: Any) -> str | None:
    """Why a size-like constructor argument read from a file is not a size (None: it is one, or not size-like).

    ``True`` is an int to Python and ``2.5`` or ``"10"`` reach the constructor as they are: each
    would build a different model, raise deep inside it, or (10**13) try to allocate it.
    ``img_size`` may also be a list of 1-3 sides.
    """
    if name not in SIZE_ARGS:
        return None
    low = 0 if name in ZERO_SIZE_ARGS else 1
    sides = value if name == "img_size" and isinstance(value, (list, tuple)) and 1 <= len(value) <= 3 else [value]
    if all(_is_size(side, low) for side in sides):
        return None
    kind = f" ({type(value).__name__})" if not isinstance(value, int) or isinstance(value, bool) else ""
    what = "a size or a list of 1-3 sizes" if name == "img_size" else "a size"
    return f"is {shown(value, 40)}{kind}, not {what} (a whole number from {low} to {MAX_SIZE_ARG:,})"


def _is_size(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_SIZE_ARG


def size_args_problem(kwargs: dict[str, Any]) -> str | None:
    """The first size-like argument of ``kwargs`` that is not a size, as ``name problem``."""
    for name, value in kwargs.items():
        problem = size_arg_problem(name, value)
        if problem:
            return f"{name} {problem}"
    return None


#: a recorded value is offered for retyping (``--model-arg key=value``) up to this many characters
MAX_RETYPED = 200


def _retyped(key: str, value: Any) -> str | None:
    """``value`` as the literal the user would type to confirm it, or None where that is too long."""
    if not key.isidentifier():  # "a=b" or " a" would come back through --model-arg as another key
        return None
    try:
        text = repr(value)
    except ValueError:  # an int of more than 4300 digits
        return None
    return text if len(key) + len(text) <= MAX_RETYPED else None


def args_keyword(flag: str) -> str:
    """The Python keyword that takes what ``{flag}-arg`` does (``model_args``, ``converted_model_args``)."""
    return FLAG_KEYWORDS.get(f"{flag}-arg", "model_args=").rstrip("=")


def python_args_hint(values: dict[str, str], flag: str = "--model", then: str = "") -> str:
    """``model_args={'key': value}`` from already-written literals, as a Python caller types it."""
    literal = "{" + ", ".join(f"{key!r}: {text}" for key, text in values.items()) + "}"
    return f"pass {args_keyword(flag)}={literal}{then}"


def _shell_word(text: str) -> str:
    """``text`` as one shell word that the shell hands on unchanged: bare, in double quotes, or shlex's quoting."""
    import shlex

    quoted = shlex.quote(text)
    if quoted == text or any(ch in text for ch in '"$`\\!'):
        return quoted
    return f'"{text}"'


def confirmation_hints(unconfirmed: dict[str, Any], flag: str) -> tuple[str, str]:
    """(command-line hint, Python hint) for recorded arguments the user must confirm.

    Values are offered whole, quoted for the shell and evaluating back to the recorded value,
    when short enough to retype; otherwise the hint is --accept-recorded-args.
    """
    retyped = {key: _retyped(key, value) for key, value in unconfirmed.items()}
    if all(text is not None for text in retyped.values()):
        typed = " ".join(f"{flag}-arg {_shell_word(f'{key}={text}')}" for key, text in retyped.items())
        hints = (
            f"confirm each with {typed} (or all with --accept-recorded-args)",
            python_args_hint(
                {key: text for key, text in retyped.items() if text is not None},
                flag,
                " (or all with accept_recorded_args=True)",
            ),
        )
        if max(map(len, hints)) <= MAX_TEXT - 200:  # whole, or not at all: a cut command would be wrong
            return hints
        why = " (the recorded values are too long together to retype)"
    else:
        odd = ", ".join(shown(key, 40) for key, text in retyped.items() if text is None)
        why = f" (the recorded value of {odd} cannot be retyped: too long, or a key --model-arg cannot spell)"
    return f"confirm them with --accept-recorded-args{why}", f"pass accept_recorded_args=True{why}"


def _same_spec(named: Architecture, recorded: Architecture) -> bool:
    return named.kind == recorded.kind and named.name == recorded.name


def same_value(a: Any, b: Any) -> bool:
    """Equal as a file records them: a typed tuple and a recorded list are the same JSON."""
    import json

    try:
        return json.dumps(a, sort_keys=True, allow_nan=False) == json.dumps(b, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):  # not (strict) JSON: cannot be what a file records
        return False


def confirm_architecture(
    recorded: Architecture,
    origin: Any,
    named: str | None = None,
    named_args: dict[str, Any] | None = None,
    *,
    accept_recorded_args: bool = False,
    flag: str = "--model",
    named_elsewhere: Architecture | None = None,
) -> Architecture:
    """The architecture to build for a file that records ``recorded``, under the trust rules.

    ``named``/``named_args`` are what the user typed for this file (``--model``,
    ``--model-arg``); of what was typed for another argument only ``named_elsewhere`` counts. A recorded factory runs only
    when ``named`` is exactly its string; a different ``named`` architecture is the user's
    own choice and gets only the user's arguments.

    ``named_elsewhere`` is a model the user named on the same command line for another
    argument (verify's SOURCE, typed or given with ``--model``): it is built anyway, so a file
    recording the same factory needs no second confirmation of it, and the arguments typed for
    it confirm the same recorded values; any other factory or value still needs confirming.
    """
    named_args = dict(named_args or {})
    elsewhere = (
        named_elsewhere
        if (
            named is None
            and named_elsewhere is not None
            and named_elsewhere.kind in ("timm", "factory")
            and _same_spec(named_elsewhere, recorded)
        )
        else None
    )
    if named is not None:
        chosen = parse_architecture(named, named_args)
        if not _same_spec(chosen, recorded):
            return chosen
    elif recorded.kind == "factory" and elsewhere is None:
        raise ConfirmationError(
            f"{origin} was made from the factory {recorded.name!r}; importing it runs code, "
            "so bnsurgeon does not run a name read from a file",
            f"if you trust that code, confirm it with {flag} {recorded.name}",
        )
    unconfirmed = {
        key: value
        for key, value in recorded.kwargs.items()
        if not (recorded.kind == "timm" and key in TENSOR_CHECKED_TIMM_ARGS)
        and recorded.kind != "transformers"  # the config is data, as config.json is to transformers itself
        and not (key in named_args and named_args[key] == value)
        and not (elsewhere is not None and key in elsewhere.kwargs and same_value(elsewhere.kwargs[key], value))
        and not accept_recorded_args
    }
    if unconfirmed:
        hint, python = confirmation_hints(unconfirmed, flag)
        raise ConfirmationError(
            f"{origin} records constructor arguments its weights cannot confirm: {describe_kwargs(unconfirmed)}",
            hint,
            python=python,
        )
    kwargs = {**recorded.kwargs, **named_args}
    return Architecture(recorded.kind, recorded.name, kwargs)

"""Names from the command line (SOURCE, DATA, --example-input) checked before anything else touches them:
the filesystem refuses some names outright (longer than it allows, a directory that cannot be searched), and
pathlib raises there instead of saying "no such file", which would read as a crash of bnsurgeon."""

from __future__ import annotations

import errno
import os

from bnsurgeon.core.errors import BnSurgeonError
from bnsurgeon.core.layout import shown

#: what stat says of a name that simply is not there: the caller's own message (no such file, timm name) applies
ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


def check_reachable(name: "str | os.PathLike", what: str, error: type[BnSurgeonError], hint: str) -> None:
    """Raise ``error`` naming ``what`` where the filesystem refuses ``name`` itself (too long, not searchable)."""
    try:
        os.stat(name)
    except OSError as failure:
        if failure.errno not in ABSENT:
            raise error(
                f"{what} {shown(os.fspath(name), 120)} cannot be used: {failure.strerror or failure}", hint
            ) from None
    except ValueError:  # a NUL character: no file has that name
        raise error(
            f"{what} {shown(os.fspath(name), 120)} holds a NUL character, which no file name can", hint
        ) from None

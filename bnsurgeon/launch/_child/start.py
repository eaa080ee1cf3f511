"""Imported by the start hook (``zz-bnsurgeon-run.pth`` in site-packages) in a process that ``bnsurgeon run``'s
script started (``BNSURGEON_RUN`` set): the run's converters for the process (``children.start_child``), or one
line and exit 1 where they cannot be installed."""

import os


def _start() -> None:
    settings = os.environ.get("BNSURGEON_RUN")
    if not settings:
        return
    try:
        from bnsurgeon.launch.children import refuse, start_child
    except BaseException as error:  # noqa: B036 - whatever stops it, the child must not train unpatched
        import sys

        sys.stderr.write(f"bnsurgeon run: cannot import bnsurgeon in this child process ({error})\n")
        os._exit(1)
    try:
        start_child(settings)
    except BaseException as error:  # noqa: B036
        refuse(error)


_start()

"""Imported by the start hook (``zz-bnsurgeon-run.pth`` in site-packages) in a process that ``bnsurgeon run``'s
script started (``BNSURGEON_RUN`` carries the run's token): the run's converters for the process
(``children.start_child``), or one line and exit 1 where they cannot be installed; nothing where that run has
ended."""

import os


def _start() -> None:
    settings = os.environ.get("BNSURGEON_RUN")
    if not settings:
        return
    from bnsurgeon.core.processes import live_run  # the standard library only

    if live_run(settings) is None:  # a run that ended (killed before removing its hook): as under python
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

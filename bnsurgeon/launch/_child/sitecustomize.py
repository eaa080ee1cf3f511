"""Run at start-up by every Python process a ``bnsurgeon run`` script starts (this directory is first on its
PYTHONPATH): when ``BNSURGEON_RUN`` holds the settings of a run that still lives, bnsurgeon's converters replace torch's, timm's, Lightning's and
mmengine's for the whole process, as in the script's own (``bnsurgeon/launch/children.py``). Then the
``sitecustomize`` this one hides, if the user has one, runs as it would have. This directory leaves
``sys.path``; it stays on PYTHONPATH for the child's own children.
"""

import os
import sys


def _start() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.get(__name__)
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    settings = os.environ.get("BNSURGEON_RUN")
    root = os.path.dirname(os.path.dirname(os.path.dirname(here)))  # the bnsurgeon the run itself uses
    if settings and _live_run(root, settings):
        sys.path.insert(0, root)
        try:
            from bnsurgeon.launch.children import refuse, start_child
        except BaseException as error:  # noqa: B036 - whatever stops it, the child must not train unpatched
            sys.stderr.write(f"bnsurgeon run: cannot import bnsurgeon in this child process ({error})\n")
            os._exit(1)
        finally:
            if sys.path and sys.path[0] == root:
                del sys.path[0]
        try:
            start_child(settings)
        except BaseException as error:  # noqa: B036
            refuse(error)
    sys.modules.pop(__name__, None)
    try:
        import sitecustomize  # noqa: F401 - the user's, if this one hid it
    except ImportError as error:
        if error.name != "sitecustomize":
            raise
        if ours is not None:  # none of theirs: the import that ran this one expects a module under the name
            sys.modules[__name__] = ours


def _live_run(root: str, settings: str) -> bool:
    """Whether ``settings`` are those of a run that still lives, read by bnsurgeon's process check loaded from its
    file alone: a process that a leaked or hand-set value reaches imports no bnsurgeon and runs as under python."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_bnsurgeon_run_processes", os.path.join(root, "bnsurgeon", "core", "processes.py")
    )
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except OSError:  # the bnsurgeon of that run is gone (uninstalled): as under python
        return False
    return module.live_run(settings) is not None


if __name__ == "sitecustomize":  # not when imported as bnsurgeon.launch._child.sitecustomize
    _start()

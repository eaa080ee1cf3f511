"""Run at start-up by every Python process a ``bnsurgeon run`` script starts (this directory is first on its
PYTHONPATH): when ``BNSURGEON_RUN`` is set, bnsurgeon's converters replace torch's, timm's, Lightning's and
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
    if settings:
        root = os.path.dirname(os.path.dirname(os.path.dirname(here)))  # the bnsurgeon the run itself uses
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


if __name__ == "sitecustomize":  # not when imported as bnsurgeon.launch._child.sitecustomize
    _start()

"""The directory ``bnsurgeon run`` puts on PYTHONPATH: see ``bnsurgeon/launch/children.py``."""

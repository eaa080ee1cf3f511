"""``bnsurgeon run``: a user's training script, unedited, with bnsurgeon's exact sync BN.

``script.py`` runs the script (or module) as ``__main__`` the way ``python`` does;
``converters.py`` swaps every known sync-BN converter (torch's, timm's, Lightning's and
mmengine's) for bnsurgeon's exact conversion while it runs; ``children.py`` (with the
``sitecustomize.py`` in ``_child/``) gives the same to the Python processes the script starts.
Nothing here imports torch until the script does.
"""

"""SOURCE -> model: timm names, factories, checkpoint files, rebuilding a bnsurgeon checkpoint, recorded
arguments and the trust rules that decide what in a file may shape a model."""

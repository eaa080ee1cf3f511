"""The on-disk format: read and validate checkpoints, write them (and their reports) atomically, carry a
training checkpoint's entries, and the conversion history a file records."""

"""Precise BN: the population statistics of every BN-family module's input over real data,
on one process or N ranks (``bnsurgeon.recalibrate``)."""

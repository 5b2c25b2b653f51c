"""Checkpoints of a run: the Orbax store a run saves to and restores from (`store`), the check of a restore target
against a saved step (`mismatch`), what a saved step holds without restoring it (`info`), and parameters alone read
from a saved step (`params`)."""

"""Checkpoints of a run: the Orbax store a run saves to and restores from (`store`), what a saved step holds
without restoring it (`info`), and parameters alone read from a saved step (`params`)."""

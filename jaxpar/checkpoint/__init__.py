"""Checkpoints of a run: the Orbax store a run saves to and restores from (`store`), the format version each step
records and every restore checks first (`format`), the step a restore reads and its saved config (`saved`), the
check of a restore target against a saved step (`mismatch`), what a saved step holds without restoring it
(`info`), and parameters alone read from a saved step (`params`)."""

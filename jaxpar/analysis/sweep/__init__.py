"""Mesh sweeps: every point of a grid of mesh shapes and config overrides planned, and optionally compiled and timed
(`run`), for a GPU cluster (`gpu`), ranked and written out (`report`)."""

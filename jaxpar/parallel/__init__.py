"""Explicit collectives used inside the train step's `jax.shard_map`."""

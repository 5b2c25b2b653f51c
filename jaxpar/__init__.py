"""jaxpar: train Flax NNX language models over a (data, fsdp, tensor, pipeline) mesh with explicit collectives."""

__version__ = "0.1.0"

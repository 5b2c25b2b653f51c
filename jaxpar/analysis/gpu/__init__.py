"""NVIDIA GPU clusters without a GPU: target descriptions (`targets`), the real train step compiled by XLA's GPU
compiler on this machine (`deviceless`), the shipped configs' proof that they fit (`check`), and the one-GPU
acceptance run (`acceptance`)."""

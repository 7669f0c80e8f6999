"""Pure FP8 op functions: no framework state, shared by Linen, NNX and plain JAX."""

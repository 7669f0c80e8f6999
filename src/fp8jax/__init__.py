"""fp8jax: FP8 training for JAX and Flax on NVIDIA Hopper GPUs.

The public API is what this module re-exports.
"""

from fp8jax import optim
from fp8jax.formats import ALL_E4M3, E4M3, E5M2, HYBRID, FormatPair, Fp8Format
from fp8jax.ops.attention import dot_product_attention
from fp8jax.ops.dense import dense
from fp8jax.ops.dot_general import dot_general
from fp8jax.ops.einsum import einsum
from fp8jax.ops.layernorm_dense import layernorm_dense
from fp8jax.ops.layernorm_mlp import layernorm_mlp
from fp8jax.ops.moe import MoEStats, moe_mlp
from fp8jax.ops.norm import layernorm
from fp8jax.ops.ragged_dot import permuted_ragged_dot, ragged_dot
from fp8jax.quantize import Fp8Array, dequantize, quantize
from fp8jax.recipes import (
    BlockScaling,
    CurrentScaling,
    DelayedScaling,
    MXFP8Scaling,
    RowwiseScaling,
)
from fp8jax.scaling import (
    DotScaleState,
    MlpScaleState,
    ScaleState,
    combine_states,
    init_state,
    take_new_state,
)
from fp8jax.xla_options import compiler_options

__version__ = "0.1.0"

__all__ = [
    "ALL_E4M3",
    "E4M3",
    "E5M2",
    "HYBRID",
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "DotScaleState",
    "FormatPair",
    "Fp8Array",
    "Fp8Format",
    "MXFP8Scaling",
    "MlpScaleState",
    "MoEStats",
    "RowwiseScaling",
    "ScaleState",
    "combine_states",
    "compiler_options",
    "dense",
    "dequantize",
    "dot_general",
    "dot_product_attention",
    "einsum",
    "init_state",
    "layernorm",
    "layernorm_dense",
    "layernorm_mlp",
    "moe_mlp",
    "optim",
    "permuted_ragged_dot",
    "quantize",
    "ragged_dot",
    "take_new_state",
]

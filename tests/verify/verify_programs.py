"""Programs the verifier tests compile, and the factories ``fp8jax verify`` imports.

Shapes are small (a compile takes about a second) but every dimension is a
multiple of 16 so FP8 GEMMs stay legal for cuBLASLt.
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax

BATCH, D_IN, D_OUT = 256, 512, 1024
FSDP = P("fsdp", None)


def fp8_train_step(x, kernel):
    """Loss and both gradients of one fp8jax.dense: 3 FP8 GEMMs (fwd, dgrad, wgrad)."""

    def loss(x, kernel):
        return jnp.sum(jnp.square(fp8jax.dense(x, kernel).astype(jnp.float32)))

    return jax.value_and_grad(loss, argnums=(0, 1))(x, kernel)


def scanned_fp8_step(x, kernels):
    """fp8jax.dense applied by lax.scan over stacked kernels: GEMMs inside a while loop."""

    def layer(h, kernel):
        return fp8jax.dense(h, kernel), None

    def loss(x, kernels):
        return jnp.sum(jnp.square(jax.lax.scan(layer, x, kernels)[0].astype(jnp.float32)))

    return jax.value_and_grad(loss, argnums=(0, 1))(x, kernels)


def attention_block_step(x, w_qkv, w_out):
    """FP8 projections around cuDNN attention (GPU only), forward and backward."""

    def loss(x, w_qkv, w_out):
        b, t, _ = x.shape
        q, k, v = jnp.split(fp8jax.dense(x, w_qkv).reshape(b, t, 3 * HEADS, -1), 3, axis=2)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(jnp.square(fp8jax.dense(o.reshape(b, t, -1), w_out).astype(jnp.float32)))

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w_qkv, w_out)


def qdq_matmul(x, kernel):
    """Quantize -> dequantize -> BF16 dot, as Flax's Fp8DotGeneralOp does: not FP8."""

    def qdq(a):
        scale = jnp.max(jnp.abs(a)).astype(jnp.float32) / jnp.float32(448.0)
        q = (a.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn)
        return (q.astype(jnp.float32) * scale).astype(jnp.bfloat16)

    return qdq(x) @ qdq(kernel)


def bf16_matmul(x, kernel):
    return x @ kernel


def dequantized_kernel_matmul(x, kernel_f8, scale):
    """A kernel stored in FP8, dequantized before a BF16 dot: an upcast, not FP8."""
    return x @ (kernel_f8.astype(jnp.bfloat16) * scale.astype(jnp.bfloat16))


def args(mesh=None, kernel_dtype=jnp.float32):
    """(x, kernel) as ShapeDtypeStructs; FSDP-sharded (batch and kernel rows) on ``mesh``."""
    shard = (lambda spec: NamedSharding(mesh, spec)) if mesh is not None else (lambda spec: None)
    x = jax.ShapeDtypeStruct((BATCH, D_IN), jnp.bfloat16, sharding=shard(FSDP))
    kernel = jax.ShapeDtypeStruct((D_IN, D_OUT), kernel_dtype, sharding=shard(FSDP))
    return x, kernel


def dequantized_args():
    x, _ = args()
    kernel = jax.ShapeDtypeStruct((D_IN, D_OUT), jnp.float8_e4m3fn)
    return x, kernel, jax.ShapeDtypeStruct((), jnp.float32)


HEADS = 4


def attention_args():
    x = jax.ShapeDtypeStruct((2, 128, D_IN), jnp.bfloat16)
    w_qkv = jax.ShapeDtypeStruct((D_IN, 3 * D_IN), jnp.float32)
    return x, w_qkv, jax.ShapeDtypeStruct((D_IN, D_IN), jnp.float32)


def scanned_args(layers=2):
    x = jax.ShapeDtypeStruct((BATCH, D_IN), jnp.bfloat16)
    return x, jax.ShapeDtypeStruct((layers, D_IN, D_IN), jnp.float32)


# Factories for `fp8jax verify verify_programs:NAME`: mesh -> (fn, args).


def fp8_entry(mesh):
    return fp8_train_step, args(_fsdp(mesh))


def bf16_entry(mesh):
    return bf16_matmul, args(_fsdp(mesh), jnp.bfloat16)


def _fsdp(mesh):
    """``mesh`` if its one axis is 'fsdp'; the tests pass --mesh fsdp=N."""
    if mesh is not None and tuple(mesh.axis_names) != ("fsdp",):
        raise ValueError(f"these programs shard over one 'fsdp' axis, got {mesh.axis_names}.")
    return mesh

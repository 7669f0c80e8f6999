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
        return fp8jax.dense(h, kernel, preferred_element_type=h.dtype), None

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


# Exchanges of FP8 rows between devices: expert parallelism's all-to-alls
# and tensor parallelism's ring, each inside shard_map over 8 devices.
EXCHANGE_ROWS, EXCHANGE_WIDTH = 64, 256
EP_AXIS = "ep"


def _fp8_rows(x):
    """``x`` in E4M3 at one scale (fp8jax.quantize) as data and reciprocal scale."""
    q, _ = fp8jax.quantize(x, fp8jax.E4M3)
    return q.data, q.scale_inv


def ep_exchange(x, sizes):
    """Expert parallelism's exchange: FP8 rows by all-to-all and ragged-all-to-all, counts in s32.

    ``x`` (8 * EXCHANGE_ROWS, EXCHANGE_WIDTH) split over ``ep``; ``sizes``
    (8, 8) s32: row i of device d goes to device i, ``sizes[d, i]`` rows each.
    """

    def local(x, sizes):
        data, scale_inv = _fp8_rows(x)
        even = jax.lax.all_to_all(data, EP_AXIS, 0, 0, tiled=True)
        received = jax.lax.all_to_all(sizes, EP_AXIS, 1, 1, tiled=True)
        send = sizes.reshape(-1)
        offsets = jnp.cumsum(send) - send
        out = jnp.zeros_like(data)
        ragged = jax.lax.ragged_all_to_all(data, out, offsets, send, offsets,
                                           received.reshape(-1), axis_name=EP_AXIS)  # fmt: skip
        both = even.astype(jnp.float32) + ragged.astype(jnp.float32)
        return both * scale_inv

    return jax.shard_map(local, in_specs=(P(EP_AXIS), P(EP_AXIS)), out_specs=P(EP_AXIS),
                         check_vma=False)(x, sizes)  # fmt: skip


def tp_ring(x):
    """Tensor parallelism's ring: each device passes its FP8 shard to the next, 7 times."""

    def local(x):
        data, scale_inv = _fp8_rows(x)
        ring = [(i, (i + 1) % 8) for i in range(8)]
        total = data.astype(jnp.float32)
        for _ in range(7):
            data = jax.lax.ppermute(data, EP_AXIS, ring)
            total = total + data.astype(jnp.float32)
        return total * scale_inv

    return jax.shard_map(local, in_specs=P(EP_AXIS), out_specs=P(EP_AXIS), check_vma=False)(x)


def exchange_args(mesh, with_sizes=True):
    """(x, sizes) as ShapeDtypeStructs split over ``mesh``'s ``ep`` axis (8 devices)."""
    split = NamedSharding(mesh, P(EP_AXIS))
    x = jax.ShapeDtypeStruct((8 * EXCHANGE_ROWS, EXCHANGE_WIDTH), jnp.bfloat16, sharding=split)
    sizes = jax.ShapeDtypeStruct((8, 8), jnp.int32, sharding=split)
    return (x, sizes) if with_sizes else (x,)

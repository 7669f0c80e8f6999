"""Flax (f32) references for the fp8jax.flax modules, and FP8 error budgets.

The references are built from Flax's own layers (nn.LayerNorm, nn.RMSNorm,
nn.DenseGeneral, nn.MultiHeadDotProductAttention, nn.dot_product_attention)
and take the fp8jax modules' parameter trees, so a test can feed both the same
parameters.

Budgets, derived from the formats. Rounding to a format with unit roundoff
u errs uniformly within half a spacing; for mantissas m spread
log-uniformly over [1, 2) the relative RMS is u sqrt(E[1/m**2] / 3) =
u sqrt(0.541 / 3) = 0.425 u (0.0265 for E4M3, u = 2**-4). A GEMM's output
errs normwise by the root sum of squares of its operands' errors, and k
independently rounded operands chained through GEMMs and Lipschitz-1
activations by about sqrt(k) of one: :func:`fp8_budget` allows 1.5 times
that. Against the fake-quant references (``fake_quant=True``), which round
each GEMM operand to E4M3 as the modules do, only f32 roundoff and the rare
FP8 rounding it moves remain: :data:`FAKE_QUANT_BUDGET`.
"""

from __future__ import annotations

import math
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from numerics import qdq
from references import ACTIVATIONS

U_E4M3 = 2.0**-4
RMS_ROUNDING = math.sqrt(0.541 / 3)  # relative RMS of a rounding, in units of u

# A module against its fake-quant reference: f32 roundoff moves an FP8
# rounding of one element now and then, one step (2**-3 of the element) in
# one of the 2 x 8 x 32 = 512 elements of an activation, normwise 2**-3 /
# sqrt(512) ~ 2**-7.5 at most; 2**-7 allows one. A wrong head grouping or
# a rotation left out errs by whole percents.
FAKE_QUANT_BUDGET = 2.0**-7


# The FP8 MoE block's gradients against the same block in f32 (fp8=False):
# each FP8 backward grouped GEMM errs elementwise by at most
# (1 + 2**-3)(1 + 2**-4)(1 + 2**-3) - 1 < 0.35 of its |.|-product
# (tests/ops/test_ragged_dot.py); norm-wise, over random signs, a small part
# of that: half of it bounds each gradient's relative norm error.
MOE_GRADIENT_BUDGET = 0.35 / 2


def gradient_errors(got, want) -> dict[str, float]:
    """Each leaf's normwise relative error ``|got - want| / |want|``, by its path in ``want``."""
    errors = {}
    for path, b in jax.tree_util.tree_leaves_with_path(want):
        a = _at(got, path)
        errors[jax.tree_util.keystr(path)] = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    return errors


def _at(tree, path):
    for key in path:
        tree = tree[key.key] if hasattr(key, "key") else tree[key.idx]
    return tree


def fp8_budget(quantized_operands: int) -> float:
    """Allowed normwise relative error after ``quantized_operands`` E4M3 roundings."""
    return 1.5 * math.sqrt(quantized_operands) * RMS_ROUNDING * U_E4M3


def relative_error(actual, expected, baseline=None) -> float:
    """``|actual - expected| / |expected - baseline|`` in the 2-norm, in f64."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = expected if baseline is None else expected - np.asarray(baseline, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(scale))


def f32(tree):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)


def randomize(params, key, scale=0.2):
    """Params with noise on everything but kernels (norm scales, biases), so none is 0 or 1."""

    def perturb(path, leaf):
        if "kernel" in jax.tree_util.keystr(path):
            return leaf
        k = jax.random.fold_in(key, zlib.crc32(jax.tree_util.keystr(path).encode()))
        noise = jax.random.normal(k, leaf.shape, jnp.float32) * scale
        return (leaf.astype(jnp.float32) + noise).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(perturb, params)


def norm(x, scale, bias, norm_type="layernorm", zero_centered_gamma=False, epsilon=1e-6):
    """flax.linen.LayerNorm / RMSNorm with the given parameters."""
    if zero_centered_gamma:
        scale = scale + jnp.ones_like(scale)
    if norm_type == "layernorm":
        return nn.LayerNorm(epsilon=epsilon).apply({"params": {"scale": scale, "bias": bias}}, x)
    return nn.RMSNorm(epsilon=epsilon).apply({"params": {"scale": scale}}, x)


def dense(x, kernel, bias=None, axis=-1, fake_quant=False):
    """flax.linen.DenseGeneral with the given kernel ``(*in, *features)``.

    ``fake_quant``: the input and the kernel rounded to E4M3 at their
    current scales first (tests/numerics.py's ``qdq``), as the FP8 modules
    quantize every GEMM operand.
    """
    n_in = len(axis) if isinstance(axis, tuple) else 1
    if fake_quant:
        x, kernel = qdq(x, "e4m3"), qdq(kernel, "e4m3")
    params = {"kernel": kernel} if bias is None else {"kernel": kernel, "bias": bias}
    layer = nn.DenseGeneral(kernel.shape[n_in:], axis=axis, use_bias=bias is not None)
    return layer.apply({"params": params}, x)


def mlp(p, x, activations=("gelu", "linear"), norm_type="layernorm", zero_centered_gamma=False,
        fake_quant=False):  # fmt: skip
    h = norm(x, p["scale"], p.get("ln_bias"), norm_type, zero_centered_gamma)
    pre = dense(h, p["kernel_1"], p.get("bias_1"), fake_quant=fake_quant)
    out = ACTIVATIONS[activations[0]](pre[..., 0, :])
    for i, name in enumerate(activations[1:], start=1):
        out = out * ACTIVATIONS[name](pre[..., i, :])
    return dense(out, p["kernel_2"], p.get("bias_2"), fake_quant=fake_quant)


def _flax_mha(p, h, num_heads, causal):
    """Flax's own MultiHeadDotProductAttention (no GQA, no RoPE) on our parameters."""
    kernel, bias = p["qkv"]["kernel"], p["qkv"].get("bias")
    params = {"out": p["out"]}
    for i, name in enumerate(("query", "key", "value")):
        params[name] = {"kernel": kernel[:, :, i, :]}
        if bias is not None:
            params[name]["bias"] = bias[:, i, :]
    layer = nn.MultiHeadDotProductAttention(
        num_heads=num_heads,
        qkv_features=num_heads * kernel.shape[-1],
        use_bias=bias is not None,
    )
    mask = nn.make_causal_mask(jnp.ones(h.shape[:2])) if causal else None
    return layer.apply({"params": params}, h, mask=mask)


def attention(
    p,
    x,
    *,
    num_heads,
    num_kv_heads=None,
    causal=False,
    rope_base=None,
    input_layernorm=True,
    norm_type="layernorm",
    use_flax_module=None,
    fake_quant=False,
):
    """Self-attention: Flax's module where it applies (no GQA, no RoPE), else Flax's core.

    ``fake_quant``: the projections' operands rounded to E4M3 (:func:`dense`),
    on Flax's core.
    """
    from fp8jax.flax.rotary import apply_rotary

    num_kv_heads = num_kv_heads or num_heads
    h = x
    if input_layernorm:
        h = norm(x, p["qkv"]["scale"], p["qkv"].get("ln_bias"), norm_type)
    if use_flax_module is None:
        use_flax_module = num_kv_heads == num_heads and rope_base is None and not fake_quant
    if use_flax_module:
        return _flax_mha(p, h, num_heads, causal)
    qkv = dense(h, p["qkv"]["kernel"], p["qkv"].get("bias"), fake_quant=fake_quant)
    batch, seq, _, _, d = qkv.shape
    group = num_heads // num_kv_heads
    q = qkv[:, :, :, :group].reshape(batch, seq, num_heads, d)
    k = jnp.repeat(qkv[:, :, :, group], group, axis=2)  # head n reads key/value head n // group
    v = jnp.repeat(qkv[:, :, :, group + 1], group, axis=2)
    if rope_base is not None:
        q = apply_rotary(q, jnp.arange(seq), base=rope_base)
        k = apply_rotary(k, jnp.arange(seq), base=rope_base)
    mask = nn.make_causal_mask(jnp.ones((batch, seq))) if causal else None
    o = nn.dot_product_attention(q, k, v, mask=mask)
    out = p["out"]
    return dense(o, out["kernel"], out.get("bias"), axis=(-2, -1), fake_quant=fake_quant)


def transformer(p, x, *, num_heads, num_kv_heads=None, activations=("gelu", "linear"),
                norm_type="layernorm", norm_position="pre", residual_from_norm=False,
                causal=False, rope_base=None, fake_quant=False):  # fmt: skip
    """The block TransformerLayer documents, from the references above."""
    attn = {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "causal": causal,
        "rope_base": rope_base,
        "norm_type": norm_type,
        "fake_quant": fake_quant,
    }
    pm = p["mlp"]
    if norm_position == "post":
        r = x + attention(p["attention"], x, input_layernorm=False, **attn)
        h = norm(r, pm["scale"], pm.get("ln_bias"), norm_type)
        m = mlp(pm, r, activations, norm_type, fake_quant=fake_quant)
        po = p["output_norm"]
        return norm(h + m, po["scale"], po.get("bias"), norm_type)
    a = attention(p["attention"], x, **attn)
    qkv = p["attention"]["qkv"]
    residual = norm(x, qkv["scale"], qkv.get("ln_bias"), norm_type) if residual_from_norm else x
    h = residual + a
    residual = norm(h, pm["scale"], pm.get("ln_bias"), norm_type) if residual_from_norm else h
    return residual + mlp(pm, h, activations, norm_type, fake_quant=fake_quant)


def init(layer, x, *args, seed=1, **kwargs):
    """``layer.init`` under jit (eager init compiles every random op on its own: slow)."""
    return jax.jit(layer.init, static_argnames=tuple(kwargs))(
        jax.random.key(seed), x, *args, **kwargs
    )


def init_params(layer, x, seed=1):
    """Unboxed params with randomized vectors, ready for both a module and its reference."""

    def make(key):
        params = nn.unbox(layer.init(key, x))["params"]
        return randomize(params, jax.random.fold_in(key, 1))

    return jax.jit(make)(jax.random.key(seed))


def apply(layer, variables, *args, **kwargs):
    """``layer.apply`` under jit; array keyword arguments traced, the others static."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array | dict)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    return jax.jit(lambda v, *a, **kw: layer.apply(v, *a, **kw, **static))(
        variables, *args, **arrays
    )


def run(fn, *args, **static):
    """``fn(*args, **static)`` under jit, the keyword arguments static."""
    return jax.jit(lambda *a: fn(*a, **static))(*args)


def linen_to_nnx_dict(variables):
    """Linen's params and fp8_state collections merged into NNX's nested-attribute layout."""

    def merge(a, b):
        out = dict(a)
        for key, value in b.items():
            out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
        return out

    variables = nn.unbox(variables)
    return merge(variables["params"], variables.get("fp8_state", {}))


def linen_vjp(layer, params, state, x, cotangent):
    """``(y, (d_params, new_state, dx))``: a Linen layer's output and its VJP at ``cotangent``.

    ``state`` (the layer's ``fp8_state`` scales, or None) is an input like the
    params, so its cotangent is the new delayed-scaling state.
    """

    def apply(params, state, x):
        variables = {"params": params}
        if state is not None:
            variables["fp8_state"] = {"scales": state}
        return layer.apply(variables, x)

    @jax.jit
    def step(params, state, x):
        y, vjp = jax.vjp(apply, params, state, x)
        return y, vjp(cotangent)

    return step(params, state, x)

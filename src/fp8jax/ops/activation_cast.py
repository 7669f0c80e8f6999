"""An MLP's activation, and its gradient, computed inside FP8 cast kernels.

Under delayed scaling the scale of the activation ``h = act(pre + bias)``
and of its gradient is known before either is computed, so each can be
computed where it is cast. XLA does so for the forward
(:func:`~fp8jax.ops.dense.quantize_recomputed`), but writes the gradient in
bf16 for the cast kernel to read back, and transposes the FP8 ``h`` for the
second GEMM's wgrad in a kernel of its own. Here two Pallas (Triton) kernels
do it all:

- :func:`cast_activation` reads ``pre`` once and writes ``h`` in FP8 with
  per-tile maxima (its amax);
- :func:`cast_activation_gradient` reads ``pre`` and ``dh`` once and writes
  the pre-activation gradient in FP8 with its transposed copy, its column
  sums (the bias's gradient) and maxima, and ``h`` again, recomputed and
  cast, transposed for the wgrad. Recomputing ``h`` costs no read that the
  gradient does not already make, where keeping the forward's transposed
  copy would hold another FP8 ``(tokens, ffn)`` array from forward to
  backward.

The activations are written through the logistic function (gelu_tanh's
``0.5 * (1 + tanh(u))`` as ``sigmoid(2u)``), which the kernels compute with
the GPU's approximate ``ex2`` and ``rcp`` instructions, each within about
2**-22 relative: a Triton kernel with libdevice's ``tanhf`` took 0.875 ms
for the transformer layer's forward activation, where XLA's two kernels
took about 0.75 ms (bench/results/h200-2026-11-30-f). Off the GPU, and with
the kernels off (``FP8JAX_PALLAS=0``), XLA computes the same formulas with
``exp`` and division. Both round ``h`` and the gradient to the activations'
dtype before the cast, as the XLA path of :func:`fp8jax.layernorm_mlp` does.

On the H200's transformer layer (TransformerEngine's shapes, gelu_tanh) the
two kernels took 0.29 + 0.75 ms where XLA's path took 1.28 ms with the
benchmarks' mean loss and 1.72 ms with a square loss; the layer's step went
from 18.70-18.76 to 18.54 ms, and from 19.13-19.24 to 18.84 ms with the
square loss (bench/results/h200-2026-11-30-i, run 9C).

Only one activation (not gated), among :data:`KERNEL_ACTIVATIONS`, and whole
tiles (:func:`fp8jax.ops.cast_transpose.fits`) take this path.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from fp8jax.formats import Fp8Format
from fp8jax.ops import cast_transpose
from fp8jax.quantize import quantize_with_scale

# Tile (rows, columns) and warps per program of each kernel: the fastest of
# seven (forward) and ten (gradient) shapes, 16-128 rows, 64-128 columns, 4-8
# warps, on the H200 at (16384, 16384) (bench/results/h200-2026-11-30-i, 9B).
FORWARD_TILE, FORWARD_WARPS = (64, 64), 4
GRADIENT_TILE, GRADIENT_WARPS = (64, 64), 4

_GELU_C = math.sqrt(2 / math.pi)
_GELU_A = 0.044715
_LOG2_E = math.log2(math.e)


def _sigmoid(z):
    return 1 / (1 + jnp.exp(-z))


def _gpu_sigmoid(z):
    """The logistic function from the GPU's ``ex2.approx`` and ``rcp.approx`` (Triton only).

    Each instruction errs by at most about 2**-22 relative; libdevice's
    ``expf`` and an IEEE division cost tens of instructions more, which made
    the gradient kernel math-bound (gelu_tanh: 0.82 against relu's 0.67 ms).
    Where ``exp`` overflows, ``rcp`` of infinity gives 0, the limit.
    """
    from jax.experimental.pallas import triton as pallas_triton

    def unary(asm, v):
        (out,) = pallas_triton.elementwise_inline_asm(
            asm, args=[v], constraints="=f,f", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, v.dtype)],
        )  # fmt: skip
        return out

    e = unary("ex2.approx.ftz.f32 $0, $1;", z * -_LOG2_E)
    return unary("rcp.approx.ftz.f32 $0, $1;", 1 + e)


def _gelu_tanh(x, sigmoid):
    # 0.5 * (1 + tanh(u)) is sigmoid(2u): in this form f32 keeps its relative
    # precision in the negative tail, where 1 + tanh(u) cancels (x = -4.8:
    # the slope is -3e-6, and the tanh form's f32 error is 20% of it).
    two_u_slope = 2 * _GELU_C * (1 + 3 * _GELU_A * x * x)
    s = sigmoid(2 * _GELU_C * (x + _GELU_A * x * x * x))
    return x * s, s + x * s * (1 - s) * two_u_slope


def _relu(x, sigmoid):
    del sigmoid
    return jnp.maximum(x, 0.0), jnp.where(x > 0, 1.0, 0.0).astype(x.dtype)


def _silu(x, sigmoid):
    s = sigmoid(x)
    return x * s, s * (1 + x * (1 - s))


# name -> (value, slope) in f32.
_ACTIVATIONS = {"gelu_tanh": _gelu_tanh, "relu": _relu, "silu": _silu}
KERNEL_ACTIVATIONS = frozenset(_ACTIVATIONS)


def activation_and_slope(name: str, x: jax.Array, sigmoid=_sigmoid):
    """``(act(x), act'(x))`` of f32 ``x`` for a name in :data:`KERNEL_ACTIVATIONS`."""
    return _ACTIVATIONS[name](x, sigmoid)


def _biased(pre_ref, bias_refs):
    x = pre_ref[...].astype(jnp.float32)
    return x + bias_refs[0][...].astype(jnp.float32) if bias_refs else x


def _forward_kernel(name, fmt, dtype, sigmoid, pre_ref, *refs):
    *bias_refs, scale_ref, q_ref, max_ref = refs
    h = activation_and_slope(name, _biased(pre_ref, bias_refs), sigmoid)[0].astype(dtype)
    h = h.astype(jnp.float32)
    q_ref[...] = quantize_with_scale(h, fmt, scale_ref[0]).data
    max_ref[...] = jnp.max(jnp.abs(h), axis=0)[None, :]


def _gradient_kernel(name, fmt, h_fmt, dtype, sigmoid, dh_ref, pre_ref, *refs):
    *bias_refs, scale_ref, h_scale_ref, q_ref, qt_ref, sum_ref, max_ref, ht_ref = refs
    h, slope = activation_and_slope(name, _biased(pre_ref, bias_refs), sigmoid)
    d_pre = (slope * dh_ref[...].astype(jnp.float32)).astype(dtype)
    cast_transpose._cast_tile(fmt, d_pre, scale_ref[0], q_ref, qt_ref, sum_ref, max_ref)
    ht_ref[...] = quantize_with_scale(h.astype(dtype), h_fmt, h_scale_ref[0]).data.T


def _specs(pl, tile, n_tiles: int, n_bias: int, n_scales: int):
    """In-specs: ``n_tiles`` (rows, cols) operands, then bias rows, then f32 scalars."""
    tile_spec = pl.BlockSpec(tile, lambda i, j: (i, j))
    bias_spec = pl.BlockSpec((1, tile[1]), lambda i, j: (0, j))
    scalar_spec = pl.BlockSpec((1,), lambda i, j: (0,))
    return [tile_spec] * n_tiles + [bias_spec] * n_bias + [scalar_spec] * n_scales


def _call(pl, kernel, grid, tile, in_specs, outputs, interpret, name, warps):
    """``pallas_call`` of ``kernel``; ``outputs``: (kind, shape, dtype), kinds in ``index``."""
    from jax.experimental.pallas import triton as pallas_triton

    index = {
        "tile": (tile, lambda i, j: (i, j)),
        "tile_t": (tile[::-1], lambda i, j: (j, i)),
        "partial": ((1, tile[1]), lambda i, j: (i, j)),
    }
    params = {} if interpret else {
        "compiler_params": pallas_triton.CompilerParams(num_warps=warps)
    }  # fmt: skip
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=[pl.BlockSpec(*index[kind]) for kind, _, _ in outputs],
        out_shape=[jax.ShapeDtypeStruct(shape, dtype) for _, shape, dtype in outputs],
        interpret=interpret,
        name=name,
        **params,
    )


def _pallas_forward(pre, biases, scale, *, name, fmt, interpret=False, tile=None, warps=None):
    """The forward kernel: ``(q, per-tile column maxima)``; ``biases``: () or (bias,)."""
    from jax.experimental import pallas as pl

    rows, cols = pre.shape
    tile, warps = tile or FORWARD_TILE, warps or FORWARD_WARPS
    grid = (rows // tile[0], cols // tile[1])
    biases = tuple(b.reshape(1, -1) for b in biases)
    sigmoid = _sigmoid if interpret else _gpu_sigmoid  # no inline assembly on the CPU
    kernel = functools.partial(_forward_kernel, name, fmt, pre.dtype, sigmoid)
    outputs = [("tile", (rows, cols), fmt.dtype), ("partial", (grid[0], cols), jnp.float32)]
    return _call(pl, kernel, grid, tile, _specs(pl, tile, 1, len(biases), 1), outputs, interpret,
                 "fp8jax_cast_activation", warps)(pre, *biases, scale.reshape(1))  # fmt: skip


def _pallas_gradient(
    dh, pre, biases, scale, h_scale, *, name, fmt, h_fmt, interpret=False, tile=None, warps=None
):
    """The backward kernel: ``(q, q_t, column sums and maxima per tile, h_t)``."""
    from jax.experimental import pallas as pl

    rows, cols = pre.shape
    tile, warps = tile or GRADIENT_TILE, warps or GRADIENT_WARPS
    grid = (rows // tile[0], cols // tile[1])
    biases = tuple(b.reshape(1, -1) for b in biases)
    sigmoid = _sigmoid if interpret else _gpu_sigmoid
    kernel = functools.partial(_gradient_kernel, name, fmt, h_fmt, pre.dtype, sigmoid)
    outputs = [
        ("tile", (rows, cols), fmt.dtype),
        ("tile_t", (cols, rows), fmt.dtype),
        ("partial", (grid[0], cols), jnp.float32),
        ("partial", (grid[0], cols), jnp.float32),
        ("tile_t", (cols, rows), h_fmt.dtype),
    ]
    return _call(pl, kernel, grid, tile, _specs(pl, tile, 2, len(biases), 2), outputs, interpret,
                 "fp8jax_cast_activation_gradient", warps)(
        dh, pre, *biases, scale.reshape(1), h_scale.reshape(1))  # fmt: skip


def _biased_xla(pre, biases):
    x = pre.astype(jnp.float32)
    return x + biases[0].astype(jnp.float32)[None, :] if biases else x


def _xla_forward(pre, biases, scale, *, name, fmt):
    """:func:`_pallas_forward`'s values from XLA."""
    x = _biased_xla(pre, biases)
    h = activation_and_slope(name, x)[0].astype(pre.dtype).astype(jnp.float32)
    tiles = h.reshape(-1, cast_transpose.BLOCK_ROWS, h.shape[1])
    return quantize_with_scale(h, fmt, scale).data, jnp.max(jnp.abs(tiles), axis=1)


def _xla_gradient(dh, pre, biases, scale, h_scale, *, name, fmt, h_fmt):
    """:func:`_pallas_gradient`'s values from XLA."""
    x = _biased_xla(pre, biases)
    h, slope = activation_and_slope(name, x)
    d_pre = (slope * dh.astype(jnp.float32)).astype(pre.dtype)
    q, q_t, sums, maxima = cast_transpose._xla_partials(d_pre, scale, fmt)
    h_t = quantize_with_scale(h.astype(pre.dtype), h_fmt, h_scale).data.T
    return q, q_t, sums, maxima, h_t


def _dispatch(pallas_fn, xla_fn, *operands):
    """The Pallas kernel on NVIDIA GPUs, XLA's equivalent elsewhere or with kernels off."""
    if not cast_transpose.enabled():
        return xla_fn(*operands)
    return lax.platform_dependent(*operands, cuda=pallas_fn, default=xla_fn)


def _on_rows(fn, operands, n_matrices, out_kinds, row_axes):
    """``fn`` per device on its rows under ``shard_map`` (see cast_transpose._split_rows)."""
    if not row_axes:
        return fn(*operands)
    specs = {"rows": P(row_axes, None), "columns": P(None, row_axes)}
    # Row-split matrices, then the biases (a tuple) and scalars, whole on every device.
    in_specs = tuple(
        P(row_axes, None) if k < n_matrices else jax.tree.map(lambda _: P(), o)
        for k, o in enumerate(operands)
    )  # fmt: skip
    return jax.shard_map(
        fn, in_specs=in_specs, out_specs=tuple(specs[kind] for kind in out_kinds),
        # pallas_call does not type its outputs by the manual axes they vary along.
        check_vma=False,
    )(*operands)  # fmt: skip


def fits(pre: jax.Array, row_shards: int = 1) -> bool:
    """Whether the kernels take a (rows, columns) ``pre`` split over ``row_shards`` devices."""
    return cast_transpose.fits(pre, row_shards)


def cast_activation(
    pre: jax.Array, bias: jax.Array | None, name: str, scale: jax.Array, fmt: Fp8Format,
    row_axes: tuple[str, ...] = (),
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``act(pre + bias)`` rounded to ``pre.dtype``, cast to FP8 at ``scale``, and its amax.

    ``pre``: (rows, columns) in whole tiles (:func:`fits`); ``bias``:
    (columns,) or None; ``name``: one of :data:`KERNEL_ACTIVATIONS`;
    ``row_axes``: the mesh axes splitting ``pre``'s rows alone
    (:func:`fp8jax.ops.cast_transpose.cast_transpose`).

    Returns ``(q, amax)``: the FP8 data and the f32 max ``|h|``.
    """
    _check(pre, name, row_axes)
    forward = functools.partial(
        _dispatch,
        functools.partial(_pallas_forward, name=name, fmt=fmt),
        functools.partial(_xla_forward, name=name, fmt=fmt),
    )
    biases = () if bias is None else (bias,)
    q, maxima = _on_rows(forward, (pre, biases, scale.astype(jnp.float32)), 1,
                         ("rows", "rows"), tuple(row_axes))  # fmt: skip
    return q, jnp.max(maxima)


def cast_activation_gradient(
    dh: jax.Array, pre: jax.Array, bias: jax.Array | None, name: str, scale: jax.Array,
    fmt: Fp8Format, h_scale: jax.Array, h_fmt: Fp8Format, row_axes: tuple[str, ...] = (),
) -> tuple[cast_transpose.CastTransposed, jax.Array]:  # fmt: skip
    """The gradient ``act'(pre + bias) * dh``, cast as cast_transpose casts, and ``h`` transposed.

    The gradient is rounded to ``pre.dtype`` and cast at ``scale`` to ``fmt``,
    with its transposed copy, f32 column sums and amax
    (:class:`~fp8jax.ops.cast_transpose.CastTransposed`). ``h`` is computed
    again as :func:`cast_activation` computes it and cast at ``h_scale`` to
    ``h_fmt``, as (columns, rows): the operand the second GEMM's wgrad reads.

    Returns ``(gradient, h_t)``.
    """
    _check(pre, name, row_axes)
    if dh.shape != pre.shape:
        raise ValueError(f"dh must have pre's shape {pre.shape}, got {dh.shape}.")
    gradient = functools.partial(
        _dispatch,
        functools.partial(_pallas_gradient, name=name, fmt=fmt, h_fmt=h_fmt),
        functools.partial(_xla_gradient, name=name, fmt=fmt, h_fmt=h_fmt),
    )
    biases = () if bias is None else (bias,)
    operands = (dh, pre, biases, scale.astype(jnp.float32), h_scale.astype(jnp.float32))
    q, q_t, sums, maxima, h_t = _on_rows(
        gradient, operands, 2, ("rows", "columns", "rows", "rows", "columns"), tuple(row_axes)
    )
    out = cast_transpose.CastTransposed(q, q_t, jnp.sum(sums, axis=0), jnp.max(maxima))
    return out, h_t


def _check(pre, name: str, row_axes) -> None:
    if name not in KERNEL_ACTIVATIONS:
        raise ValueError(f"name must be one of {sorted(KERNEL_ACTIVATIONS)}, got {name!r}.")
    if not fits(pre, cast_transpose.devices_along(tuple(row_axes))):
        raise ValueError(
            f"pre must be 2-D with rows a multiple of {cast_transpose.BLOCK_ROWS} per device "
            f"and columns a multiple of {cast_transpose.BLOCK_COLS}, got shape {pre.shape}."
        )

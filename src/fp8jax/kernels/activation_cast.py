"""An MLP's activation, and its gradient, computed inside FP8 cast kernels.

Under delayed scaling the scale of the activation ``h`` (one activation of
``pre + bias``, or a gated pair's product: GeGLU, SwiGLU) and of its
gradient is known before either is computed, so each can be computed where
it is cast. XLA does so for the forward
(:class:`~fp8jax.ops.quantizing.Recomputed`), but writes the gradient in
bf16 for the cast kernel to read back, and transposes the FP8 ``h`` for the
second GEMM's wgrad in a kernel of its own. Here two Pallas (Triton)
kernels do it all:

- :func:`cast_activation` reads ``pre`` once and writes ``h`` in FP8 with
  per-tile maxima (its amax);
- :func:`cast_activation_gradient` reads ``pre`` and ``dh`` once and writes
  the pre-activation gradient in FP8 with its transposed copy, its column
  sums (the bias's gradient) and maxima, and ``h`` again, recomputed and
  cast, transposed for the wgrad. Recomputing ``h`` costs no read that the
  gradient does not already make, where keeping the forward's transposed
  copy would hold another FP8 ``(tokens, ffn)`` array from forward to
  backward.

A gated pair's ``pre`` comes interleaved, each row's two branches side by
side (``fp8jax.ops.layernorm_mlp._interleave``), and its gradient leaves the same way.

The activations are written through the logistic function and ``erfc``
(gelu_tanh's ``0.5 * (1 + tanh(u))`` as ``sigmoid(2u)``, gelu's ``Phi`` as
``erfc(-x / sqrt(2)) / 2``), forms that keep f32's relative precision in the
negative tail. The kernels compute them with the GPU's approximate ``ex2``
and ``rcp`` instructions, each within about 2**-22 relative, and ``erfc``
from Numerical Recipes' approximation (within 1.2e-7): a Triton kernel with
libdevice's ``tanhf`` was slower than XLA's two kernels for the transformer
layer's forward activation (docs/design.md#the-activation-inside-the-cast-kernels).
Off the GPU, and with the kernels off
(``fp8jax.kernels.use_pallas(False)``), XLA computes the same formulas with ``exp``,
``erfc`` and division. Both round ``h`` and the gradient to the activations'
dtype before the cast, as the XLA path of :func:`fp8jax.layernorm_mlp` does.

On the H200's transformer layer (TransformerEngine's shapes, gelu_tanh) the
two kernels took less time than XLA's path, and more so with a loss whose
gradient depends on the output (docs/design.md#the-activation-inside-the-cast-kernels).
Which activations
:func:`fp8jax.layernorm_mlp` sends here is its own choice, by measurement
(:attr:`fp8jax.activations.Activation.kernel`).

The kernels' formulas are :attr:`fp8jax.activations.Activation.value_and_slope`.
One or two activations among :data:`KERNEL_ACTIVATIONS`, and whole tiles
(:func:`fits`), take this path.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from fp8jax import activations as activations_
from fp8jax.formats import Fp8Format
from fp8jax.kernels import cast_transpose, dispatch
from fp8jax.quantize import quantize_with_scale

# The kernels' tile of h, (rows, columns), and warps per program, by the
# number of activations n; pre and its gradient are read and written n times
# as wide. The fastest on the H200 of 5-10 shapes (16-128 rows, 32-128
# columns, 2-8 warps) for gelu_tanh at (16384, 16384) and for GeGLU and
# SwiGLU at (16384, 2 x 8192), swept again once the gradient kernel stored
# h_t first (16-256 rows, 32-256 columns, 2-8 warps): 32 x 64 for two
# activations' gradient, 64 x 64 for one
# (docs/design.md#the-activation-inside-the-cast-kernels).
FORWARD_TILES = {1: ((64, 64), 4), 2: ((64, 64), 4)}
GRADIENT_TILES = {1: ((64, 64), 4), 2: ((32, 64), 4)}
ROWS_MULTIPLE, COLUMNS_MULTIPLE = 64, 64

_LOG2_E = math.log2(math.e)
# Numerical Recipes' erfc: t * exp(-z*z + poly(t)), t = 1 / (1 + z / 2), z >= 0,
# within 1.2e-7 relative everywhere; these are its published coefficients.
_ERFC_POLY = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
              0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)  # fmt: skip


_XlaMath = activations_.XlaMath


class _GpuMath:
    """The same from the GPU's ``ex2.approx`` and ``rcp.approx`` (Triton only).

    Each instruction errs by at most about 2**-22 relative; libdevice's
    ``expf`` and an IEEE division cost tens of instructions more, which made
    the gradient kernel math-bound (gelu_tanh's then took a fifth longer
    than relu's).
    Pallas's Triton lowering has no ``erfc``: it comes from Numerical
    Recipes' approximation on these two.
    """

    @staticmethod
    def _unary(asm, v):
        from jax.experimental.pallas import triton as pallas_triton

        (out,) = pallas_triton.elementwise_inline_asm(
            asm, args=[v], constraints="=f,f", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, v.dtype)],
        )  # fmt: skip
        return out

    @classmethod
    def exp(cls, v):
        return cls._unary("ex2.approx.ftz.f32 $0, $1;", v * _LOG2_E)

    @classmethod
    def rcp(cls, v):
        return cls._unary("rcp.approx.ftz.f32 $0, $1;", v)

    @classmethod
    def erfc(cls, w):
        return erfc_approximation(w, cls)


def erfc_approximation(w, m=_XlaMath):
    """Numerical Recipes' ``erfc(w)`` from ``m``'s ``exp`` and ``rcp``."""
    z = jnp.abs(w)
    t = m.rcp(1 + 0.5 * z)
    poly = _ERFC_POLY[-1]
    for c in reversed(_ERFC_POLY[:-1]):
        poly = poly * t + c
    r = t * m.exp(poly - z * z)
    return jnp.where(w >= 0, r, 2 - r)


# Every registered activation has the kernels' formula.
KERNEL_ACTIVATIONS = frozenset(activations_.REGISTRY)


def activation_and_slope(name: str, x: jax.Array, math_=_XlaMath):
    """``(act(x), act'(x))`` of f32 ``x`` for a name in :data:`KERNEL_ACTIVATIONS`."""
    return activations_.REGISTRY[name].value_and_slope(x, math_)


_branches = cast_transpose.split_branches


def _interleaved(parts):
    """The inverse of :func:`_branches`."""
    if len(parts) == 1:
        return parts[0]
    rows, cols = parts[0].shape
    return jnp.stack(parts, axis=-1).reshape(rows, 2 * cols)


def _gated(activations, x, m):
    """``h`` and each branch's gradient factor ``d h / d branch``, of a biased f32 tile."""
    branches = _branches(x, len(activations))
    pairs = [
        activation_and_slope(name, v, m) for name, v in zip(activations, branches, strict=True)
    ]
    values, slopes = [v for v, _ in pairs], [s for _, s in pairs]
    if len(values) == 1:
        return values[0], slopes
    (v0, v1), (s0, s1) = values, slopes
    return v0 * v1, (s0 * v1, v0 * s1)


def _biased(pre_ref, bias_refs):
    x = pre_ref[...].astype(jnp.float32)
    return x + bias_refs[0][...].astype(jnp.float32) if bias_refs else x


def _forward_kernel(activations, fmt, dtype, m, maxima, pre_ref, *refs):
    if maxima:
        *bias_refs, scale_ref, q_ref, max_ref = refs
    else:
        *bias_refs, scale_ref, q_ref = refs
    h = _gated(activations, _biased(pre_ref, bias_refs), m)[0].astype(dtype)
    h = h.astype(jnp.float32)
    q_ref[...] = quantize_with_scale(h, fmt, scale_ref[0]).data
    if maxima:
        max_ref[...] = cast_transpose.tile_max(h)


def _gradient_kernel(activations, fmt, h_fmt, dtype, m, has_bias, dh_ref, pre_ref, *refs):
    # The column sums are the bias's gradient: without a bias there are none.
    if has_bias:
        bias_ref, scale_ref, h_scale_ref, q_ref, qt_ref, sum_ref, max_ref, ht_ref = refs
        bias_refs = (bias_ref,)
    else:
        scale_ref, h_scale_ref, q_ref, qt_ref, max_ref, ht_ref = refs
        bias_refs, sum_ref = (), None
    h, factors = _gated(activations, _biased(pre_ref, bias_refs), m)
    dh = dh_ref[...].astype(jnp.float32)
    d_pre = _interleaved([f * dh for f in factors]).astype(dtype)
    # h's transposed copy is stored before the gradient's cast, transposes and
    # reductions, so that h is not live across them; dh is read before that
    # store. Same bytes, 5-17% faster on the H200 for every activation
    # (docs/design.md#the-activation-inside-the-cast-kernels); storing h_t
    # before reading dh was slower for gelu_tanh.
    ht_ref[...] = quantize_with_scale(h.astype(dtype), h_fmt, h_scale_ref[0]).data.T
    cast_transpose.cast_tile(fmt, d_pre, scale_ref[0], q_ref, qt_ref, sum_ref, max_ref,
                             len(activations))  # fmt: skip


def _call(pl, kernel, grid, tile, n, inputs, outputs, interpret, name, warps):
    """``pallas_call`` of ``kernel`` over tiles of h; ``inputs``, ``outputs``: kinds in ``index``.

    ``tile`` is h's; the "pre" kinds are ``n`` times as wide; "pre_t" is
    the gradient's transposed copy, branch-major
    (:func:`fp8jax.kernels.cast_transpose.branch_major`), as (n, columns, rows)
    for a gated pair.
    """
    from jax.experimental.pallas import triton as pallas_triton

    rows, cols = tile
    pre_t = ((cols, rows), lambda i, j: (j, i))
    if n > 1:
        pre_t = ((n, cols, rows), lambda i, j: (0, j, i))
    index = {
        "h": ((rows, cols), lambda i, j: (i, j)),
        "h_t": ((cols, rows), lambda i, j: (j, i)),
        "pre": ((rows, n * cols), lambda i, j: (i, j)),
        "pre_t": pre_t,
        "pre_partial": ((1, n * cols), lambda i, j: (i, j)),
        "tile_max": ((1, 1), lambda i, j: (i, j)),
        "bias": ((1, n * cols), lambda i, j: (0, j)),
        "scalar": ((1,), lambda i, j: (0,)),
    }
    params = {} if interpret else {
        "compiler_params": pallas_triton.CompilerParams(num_warps=warps)
    }  # fmt: skip
    return dispatch.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.BlockSpec(*index[kind]) for kind in inputs],
        out_specs=[pl.BlockSpec(*index[kind]) for kind, _, _ in outputs],
        out_shape=[jax.ShapeDtypeStruct(shape, dtype) for _, shape, dtype in outputs],
        interpret=interpret,
        name=name,
        **params,
    )


def _pallas_forward(pre, biases, scale, *, activations, fmt, maxima=True, interpret=False,
                    tile=None, warps=None):  # fmt: skip
    """The forward kernel: ``(q, one maximum per tile)``; ``biases``: () or (bias,).

    ``maxima`` False: ``(q,)``, the maxima neither computed nor written.
    """
    from jax.experimental import pallas as pl

    n = len(activations)
    rows, cols = pre.shape[0], pre.shape[1] // n
    tile, warps = tile or FORWARD_TILES[n][0], warps or FORWARD_TILES[n][1]
    grid = (rows // tile[0], cols // tile[1])
    biases = tuple(b.reshape(1, -1) for b in biases)
    m = _XlaMath if interpret else _GpuMath  # no inline assembly on the CPU
    kernel = functools.partial(_forward_kernel, activations, fmt, pre.dtype, m, maxima)
    inputs = ["pre", *["bias"] * len(biases), "scalar"]
    outputs = [("h", (rows, cols), fmt.dtype), *[("tile_max", grid, jnp.float32)] * maxima]
    return _call(pl, kernel, grid, tile, n, inputs, outputs, interpret, "fp8jax_cast_activation",
                 warps)(pre, *biases, scale.reshape(1))  # fmt: skip


def _pallas_gradient(dh, pre, biases, scale, h_scale, *, activations, fmt, h_fmt,
                     interpret=False, tile=None, warps=None):  # fmt: skip
    """The backward kernel: ``(q, q_t, column sums per tile of rows, maxima per tile, h_t)``.

    Without a bias (``biases`` ()) there are no column sums: ``(q, q_t, maxima, h_t)``.
    """
    from jax.experimental import pallas as pl

    n = len(activations)
    rows, cols = dh.shape
    tile, warps = tile or GRADIENT_TILES[n][0], warps or GRADIENT_TILES[n][1]
    grid = (rows // tile[0], cols // tile[1])
    biases = tuple(b.reshape(1, -1) for b in biases)
    m = _XlaMath if interpret else _GpuMath
    kernel = functools.partial(_gradient_kernel, activations, fmt, h_fmt, pre.dtype, m,
                               bool(biases))  # fmt: skip
    inputs = ["h", "pre", *["bias"] * len(biases), "scalar", "scalar"]
    outputs = [
        ("pre", (rows, n * cols), fmt.dtype),
        ("pre_t", (cols, rows) if n == 1 else (n, cols, rows), fmt.dtype),
        *[("pre_partial", (grid[0], n * cols), jnp.float32)] * len(biases),
        ("tile_max", grid, jnp.float32),
        ("h_t", (cols, rows), h_fmt.dtype),
    ]
    q, q_t, *rest = _call(pl, kernel, grid, tile, n, inputs, outputs, interpret,
                          "fp8jax_cast_activation_gradient", warps)(
        dh, pre, *biases, scale.reshape(1), h_scale.reshape(1))  # fmt: skip
    return (q, q_t.reshape(n * cols, rows), *rest)


def _biased_xla(pre, biases):
    x = pre.astype(jnp.float32)
    return x + biases[0].astype(jnp.float32)[None, :] if biases else x


def _xla_forward(pre, biases, scale, *, activations, fmt, maxima=True):
    """:func:`_pallas_forward`'s values from XLA."""
    h = _gated(activations, _biased_xla(pre, biases), _XlaMath)[0]
    h = h.astype(pre.dtype).astype(jnp.float32)
    q = quantize_with_scale(h, fmt, scale).data
    if not maxima:
        return (q,)
    return q, cast_transpose.tile_maxima(h, FORWARD_TILES[len(activations)][0])


def _xla_gradient(dh, pre, biases, scale, h_scale, *, activations, fmt, h_fmt):
    """:func:`_pallas_gradient`'s values from XLA."""
    h, factors = _gated(activations, _biased_xla(pre, biases), _XlaMath)
    dh = dh.astype(jnp.float32)
    d_pre = _interleaved([f * dh for f in factors]).astype(pre.dtype)
    (tile_rows, tile_cols), n = GRADIENT_TILES[len(activations)][0], len(activations)
    partials = cast_transpose.xla_partials(
        d_pre, scale, fmt, (tile_rows, n * tile_cols), column_sums=bool(biases), branches=n
    )
    h_t = quantize_with_scale(h.astype(pre.dtype), h_fmt, h_scale).data.T
    return *partials, h_t


def fits(shape: tuple[int, ...], n: int = 1, row_shards: int = 1) -> bool:
    """Whether the kernels take a (rows, n * columns) pre of ``shape``, rows over ``row_shards``."""
    return (
        len(shape) == 2
        and shape[0] % (ROWS_MULTIPLE * row_shards) == 0
        and shape[1] % (n * COLUMNS_MULTIPLE) == 0
    )


def cast_activation(
    pre: jax.Array, bias: jax.Array | None, activations: tuple[str, ...], scale: jax.Array,
    fmt: Fp8Format, row_axes: tuple[str, ...] = (), maxima: bool = True,
) -> tuple[jax.Array, jax.Array | None]:  # fmt: skip
    """``h``, the (gated) activation of ``pre + bias`` in ``pre.dtype``, in FP8, and its amax.

    ``activations``: one or two names from :data:`KERNEL_ACTIVATIONS`; two
    multiply (GLU): ``("gelu", "linear")`` is GeGLU. ``pre``: (rows, n *
    columns) for n activations, each row's branches interleaved (column
    ``n * c + k`` is branch ``k`` of column ``c``), in whole tiles
    (:func:`fits`); ``bias``: (n * columns,) likewise, or None; ``row_axes``:
    the mesh axes splitting ``pre``'s rows alone
    (:func:`fp8jax.kernels.cast_transpose.cast_transpose`).

    Returns ``(q, maxima)``: ``h``'s (rows, columns) FP8 data at ``scale``
    and f32 maxima of ``|h|`` per tile, whose maximum is the amax; with
    ``maxima`` False (a caller that knows the amax already: current
    scaling took it to choose ``scale``) None for them. The tile maximum
    is most of the kernel's time: at Llama's SwiGLU shapes on the H200 it
    took 0.59-0.65 ms with the maxima and 0.33-0.39 ms without
    (docs/design.md#the-activation-inside-the-cast-kernels).
    """
    activations = _check(pre, activations, row_axes)
    biases = () if bias is None else (bias,)
    kwargs = {"activations": activations, "fmt": fmt, "maxima": maxima}
    outputs = dispatch.on_each_device(
        functools.partial(_pallas_forward, **kwargs), functools.partial(_xla_forward, **kwargs),
        (pre, biases, scale.astype(jnp.float32)), 1, ("rows",) * (1 + maxima), tuple(row_axes),
    )  # fmt: skip
    return outputs[0], outputs[1] if maxima else None


def cast_activation_gradient(
    dh: jax.Array, pre: jax.Array, bias: jax.Array | None, activations: tuple[str, ...],
    scale: jax.Array, fmt: Fp8Format, h_scale: jax.Array, h_fmt: Fp8Format,
    row_axes: tuple[str, ...] = (),
) -> tuple[cast_transpose.CastTransposed, jax.Array]:  # fmt: skip
    """``pre``'s gradient from ``h``'s, ``dh``, cast as cast_transpose casts, and ``h`` transposed.

    ``pre``, ``bias``, ``activations`` as for :func:`cast_activation`; ``dh``
    is (rows, columns). The gradient, interleaved as ``pre``, is rounded to
    ``pre.dtype`` and cast at ``scale`` to ``fmt``, with its transposed copy
    branch-major (:func:`fp8jax.kernels.cast_transpose.branch_major`: each
    branch's rows together, so that kernel_1's wgrad GEMM writes the
    parameter's own layout), f32 column sums (with a bias, whose gradient they are; else None) and
    maxima (:class:`~fp8jax.kernels.cast_transpose.CastTransposed`).
    ``h`` is computed again as :func:`cast_activation` computes it and cast
    at ``h_scale`` to ``h_fmt``, as (columns, rows): the operand the second
    GEMM's wgrad reads.

    Returns ``(gradient, h_t)``.
    """
    activations = _check(pre, activations, row_axes)
    n = len(activations)
    if dh.shape != (pre.shape[0], pre.shape[1] // n):
        raise ValueError(
            f"dh must be (rows, columns) = {(pre.shape[0], pre.shape[1] // n)} for pre "
            f"{pre.shape} and {n} activation(s), got {dh.shape}."
        )
    biases = () if bias is None else (bias,)
    outputs = dispatch.on_each_device(
        functools.partial(_pallas_gradient, activations=activations, fmt=fmt, h_fmt=h_fmt),
        functools.partial(_xla_gradient, activations=activations, fmt=fmt, h_fmt=h_fmt),
        (dh, pre, biases, scale.astype(jnp.float32), h_scale.astype(jnp.float32)), 2,
        ("rows", "columns", *["rows"] * len(biases), "rows", "columns"), tuple(row_axes),
    )  # fmt: skip
    q, q_t, *partial_sums, maxima, h_t = outputs
    column_sums = cast_transpose.summed_partials(partial_sums)
    return cast_transpose.CastTransposed(q, q_t, column_sums, maxima), h_t


def _check(pre, activations, row_axes) -> tuple[str, ...]:
    activations = activations_.check(activations)
    n, shards = len(activations), dispatch.devices_along(tuple(row_axes))
    if not fits(pre.shape, n, shards):
        raise ValueError(
            f"pre must be 2-D with rows a multiple of {ROWS_MULTIPLE} per device ({shards} "
            f"device(s)) and columns a multiple of {n} x {COLUMNS_MULTIPLE}, got shape "
            f"{pre.shape}."
        )
    return activations

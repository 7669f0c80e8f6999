"""The fused ops' ``residual`` input: the residual add inside the norm's pass.

``op(x, ..., residual=a)`` must be ``op(x + a, ...)`` with the sum returned as the
residual: same bytes forward (the norm reads the stream's rounded sum either way) and
the sum's gradient for both inputs. Checked through the Pallas kernels in interpret
mode and through their XLA twins, under both scaling recipes, in bf16 (the residual
stream's dtype). The kernels themselves are checked against an f64 norm of the sum in
tests/kernels/test_norm_forward.py.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_fused_kernels_reference import interpret  # noqa: F401 (a fixture)

import fp8jax
from fp8jax.kernels import norm_forward

ROWS, HIDDEN, FFN = 2 * norm_forward.ROWS_PER_PROGRAM, 128, 256
RECIPES = {"current": fp8jax.CurrentScaling(), "delayed": fp8jax.DelayedScaling()}


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    x = (2 * jax.random.normal(k[0], (ROWS, HIDDEN)) + 0.5).astype(jnp.bfloat16)
    a = jax.random.normal(k[1], (ROWS, HIDDEN)).astype(jnp.bfloat16)
    gamma = 1 + 0.3 * jax.random.normal(k[2], (HIDDEN,))
    c = jax.random.normal(k[3], (ROWS, HIDDEN)).astype(jnp.bfloat16)
    c_sum = jax.random.normal(k[4], (ROWS, HIDDEN)).astype(jnp.bfloat16)
    return x, a, gamma, c, c_sum, k[5]


def _ops(recipe, key):
    k1, k2 = jax.random.split(key)
    w = 0.1 * jax.random.normal(k1, (HIDDEN, HIDDEN))
    w1 = 0.1 * jax.random.normal(k1, (HIDDEN, 2, FFN))
    w2 = 0.1 * jax.random.normal(k2, (FFN, HIDDEN))
    kw = {"norm_type": "rmsnorm", "recipe": recipe, "return_residual": True}

    def dense(x, gamma, state, **more):
        return fp8jax.layernorm_dense(x, gamma, None, w, state=state, **kw, **more)

    def mlp(x, gamma, state, **more):
        return fp8jax.layernorm_mlp(x, gamma, None, w1, w2, activations=("silu", "linear"),
                                    state=state, **kw, **more)  # fmt: skip

    groups = {"layernorm_dense": fp8jax.DotScaleState, "layernorm_mlp": fp8jax.MlpScaleState}
    return {"layernorm_dense": dense, "layernorm_mlp": mlp}, groups


def _run(op, recipe, group, x, a, gamma, c, c_sum, fused: bool, materialized: bool = False):
    state = fp8jax.init_state(recipe, group) if isinstance(recipe, fp8jax.DelayedScaling) else None

    def loss(x, a, gamma, state):
        if fused:
            y, total = op(x, gamma, state, residual=a)
        elif materialized:
            # The kernels read the sum from memory, rounded to bf16; without the
            # barrier XLA may read x + a in f32 where it fuses the add into the norm's
            # backward (its excess precision), as the XLA twins do either way.
            y, total = op(jax.lax.optimization_barrier(x + a), gamma, state)
        else:
            y, total = op(x + a, gamma, state)
        f32 = jnp.float32
        y_loss = jnp.sum(y.astype(f32) * c.astype(f32))
        return y_loss + jnp.sum(total.astype(f32) * c_sum.astype(f32)), (y, total)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    return grad(x, a, gamma, state)


@pytest.mark.parametrize("path", ["kernels", "twins"])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("name", ["layernorm_dense", "layernorm_mlp"])
def test_the_residual_input_is_the_op_of_the_sum_bitwise(name, recipe, path, request):
    if path == "kernels":
        request.getfixturevalue("interpret")
    x, a, gamma, c, c_sum, key = _inputs()
    ops, groups = _ops(RECIPES[recipe], key)
    args = (ops[name], RECIPES[recipe], groups[name], x, a, gamma, c, c_sum)
    (dx, da, dgamma, dstate), (y, total) = _run(*args, fused=True)
    reference = _run(*args, fused=False, materialized=path == "kernels")
    (dsum, _, want_dgamma, want_dstate), (want_y, want_total) = reference
    np.testing.assert_array_equal(total, x + a)
    np.testing.assert_array_equal(total, want_total)
    np.testing.assert_array_equal(y, want_y)
    # Both inputs of the add take the sum's gradient, from the norm's one backward pass.
    np.testing.assert_array_equal(dx, dsum)
    np.testing.assert_array_equal(da, dsum)
    np.testing.assert_array_equal(dgamma, want_dgamma)
    for got, want in zip(jax.tree.leaves(dstate), jax.tree.leaves(want_dstate), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["layernorm_dense", "layernorm_mlp"])
def test_a_residual_of_another_shape_or_dtype_is_refused_by_name(name):
    x, a, gamma, *_, key = _inputs()
    ops, _ = _ops(None, key)
    with pytest.raises(ValueError, match=r"residual must have x's shape \(32, 128\) and dtype "
                                         r"bfloat16.*got shape \(32, 64\)"):  # fmt: skip
        ops[name](x, gamma, None, residual=a[:, :64])
    with pytest.raises(ValueError, match="dtype bfloat16.*got shape.*and dtype float32"):
        ops[name](x, gamma, None, residual=a.astype(jnp.float32))


def _stream_reads(hlo: str, elements: int) -> int:
    """Operands of the entry's kernels (fusions, custom calls) that are bf16 arrays of
    ``elements`` elements: the reads of a (tokens, hidden) residual stream."""
    entry = hlo[hlo.index("\nENTRY") :].split("\n}\n")[0]
    types, reads = {}, 0
    for line in entry.splitlines()[1:]:
        made = re.match(r"\s*(?:ROOT )?(%\S+) = (\(.*?\)|\S+) (\S+?)\((.*?)\)(?:, |$)", line)
        if not made:
            continue
        name, typ, op, operands = made.groups()
        types[name] = typ
        if op in ("fusion", "custom-call"):
            for operand in re.findall(r"%[\w.\-]+", operands):
                shape = re.match(r"bf16\[([\d,]+)\]", types.get(operand, ""))
                reads += bool(shape) and math.prod(map(int, shape.group(1).split(","))) == elements
    return reads


@pytest.mark.deviceless
def test_the_residual_add_saves_a_read_of_the_stream_in_the_compiled_block():
    """Deviceless H100 compile of an MLP block with its residual add: one read of the
    (tokens, hidden) stream fewer with the add in the norm's pass, forward and step.

    Without it XLA adds x and the branch in a pass of its own (two reads, one write),
    before the norm's maxima pass reads the sum again; folded in, the maxima pass reads
    the two inputs and writes the sum the cast pass reads (current scaling).
    """
    from fp8jax import verify

    # Sizes: the kernels' placement and the passes over the stream are the same at
    # (4096, 1024, 2048) as here (reads [5, 4, 9, 8] at both), the compiles of the two
    # steps 3 times faster here.
    tokens, hidden, ffn = 1024, 512, 1024
    stream = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
    args = (stream, stream, jax.ShapeDtypeStruct((hidden,), jnp.float32),
            jax.ShapeDtypeStruct((hidden, 2, ffn), jnp.float32),
            jax.ShapeDtypeStruct((ffn, hidden), jnp.float32))  # fmt: skip

    def block(fused):
        def forward(x, a, gamma, w1, w2):
            kw = {"activations": ("silu", "linear"), "norm_type": "rmsnorm",
                  "return_residual": True}  # fmt: skip
            if fused:
                y, h = fp8jax.layernorm_mlp(x, gamma, None, w1, w2, residual=a, **kw)
            else:
                y, h = fp8jax.layernorm_mlp(x + a, gamma, None, w1, w2, **kw)
            return h + y

        return forward

    def step(fused):
        def loss(*args):
            return jnp.sum(block(fused)(*args).astype(jnp.float32))

        return jax.grad(loss, argnums=tuple(range(5)))

    calls = [(make(fused), args) for make in (block, step) for fused in (False, True)]
    hlos = verify.compile_many(calls, target="h100")
    reads = [_stream_reads(hlo, tokens * hidden) for hlo in hlos]
    forward_unfused, forward_fused, step_unfused, step_fused = reads
    assert forward_fused == forward_unfused - 1, reads
    assert step_fused == step_unfused - 1, reads

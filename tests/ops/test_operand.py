"""fp8jax.ops.operand and fp8jax.ops.quantizing: one quantized-operand type from one entry point."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.ops.operand import QuantizedOperand
from fp8jax.ops.quantizing import Recomputed, quantize_operand
from fp8jax.recipes import PER_TENSOR, Granularity


def _value(shape):
    return (jax.random.normal(jax.random.key(0), shape) * 3).astype(jnp.bfloat16)


def _bytes(a):
    return np.asarray(a.astype(jnp.float32))


def test_the_cast_kernel_writes_the_transposed_copy_of_the_same_bytes():
    # 256 x 128 fills the cast kernel's tiles; on the CPU its XLA twin runs.
    recipe = fp8jax.CurrentScaling()
    value = _value((2, 128, 128))

    @jax.jit  # both passes in one program: eagerly every step compiled on its own
    def quantize_both(value):
        return (quantize_operand(value, fp8jax.E4M3, None, recipe, rows_ndim=2, transpose=True),
                quantize_operand(value, fp8jax.E4M3, None, recipe))  # fmt: skip

    both, plain = quantize_both(value)
    assert both.has_transposed and not plain.has_transposed
    np.testing.assert_array_equal(_bytes(both.fp8.data), _bytes(plain.fp8.data))
    np.testing.assert_array_equal(_bytes(both.transposed.data),
                                  _bytes(plain.fp8.data.reshape(256, 128).T))  # fmt: skip
    assert both.for_wgrad().transposed and both.for_wgrad().fp8 is both.transposed
    assert not plain.for_wgrad().transposed and plain.for_wgrad().fp8 is plain.fp8


@pytest.mark.parametrize("case", ["shape outside whole tiles", "kernels switched off"])
def test_without_the_kernel_the_operand_has_no_transposed_copy(case):
    # The dispatcher's decision is taken before the pass: XLA's pass then
    # quantizes, and the operand says so by type, not by a None result.
    recipe = fp8jax.CurrentScaling()
    value = _value((96, 80) if case == "shape outside whole tiles" else (256, 128))
    with fp8jax.kernels.use_pallas(case != "kernels switched off"):
        kw = {"rows_ndim": 1, "transpose": True, "column_sums": True}
        quantize = jax.jit(lambda v: quantize_operand(v, fp8jax.E5M2, None, recipe, **kw))
        q = quantize(value)  # traced here, under use_pallas
    assert isinstance(q, QuantizedOperand) and not q.has_transposed
    assert q.column_sums.shape == value.shape[1:] and q.column_sums.dtype == jnp.float32


def test_a_quantized_operand_is_a_pytree_with_static_granularity():
    q = quantize_operand(_value((8, 16)), fp8jax.E4M3, None, fp8jax.CurrentScaling())
    leaves, treedef = jax.tree.flatten(q)
    assert len(leaves) == 3  # data, scale_inv, amax: no transposed copy, no sums
    again = jax.tree.unflatten(treedef, leaves)
    assert again.granularity == PER_TENSOR and again.format == fp8jax.E4M3
    assert jnp.shape(q.fp8.scale_inv) == PER_TENSOR.scale_shape(8, 16) == ()


def test_granularities_give_the_scale_shapes_finer_recipes_fill():
    assert Granularity("row").scale_shape(64, 256) == (64, 1)
    assert Granularity("tile", 128).scale_shape(64, 300) == (64, 3)
    assert Granularity("block", 128).scale_shape(256, 384) == (2, 3)
    with pytest.raises(ValueError, match="kind must be one of"):
        Granularity("column")
    with pytest.raises(ValueError, match="an int > 0 for kind='tile' or 'block'"):
        Granularity("block")
    with pytest.raises(ValueError, match="an int > 0 for kind='tile' or 'block'"):
        Granularity("row", 128)


FINE = [fp8jax.RowwiseScaling(), fp8jax.BlockScaling(), fp8jax.MXFP8Scaling()]
# A block's scales serve its transpose: a block operand has no second copy (tested below).
FINE_CASES = [
    pytest.param(recipe, role, transpose, id=f"{type(recipe).__name__}-{role}-{transpose}")
    for recipe in FINE
    for role in ("x", "kernel", "grad")
    for transpose in (False, True)
    if not (transpose and recipe.granularity(role).kind == "block")
]


@pytest.mark.parametrize(("recipe", "role", "transpose"), FINE_CASES)
def test_fine_operands_have_the_scale_shape_their_recipe_declares(recipe, role, transpose):
    # One entry point for every recipe: the scale's shape says the
    # granularity recipe.granularity(role) declares, for a (1, rows, K) operand.
    rows, k = 256, 384
    declared = recipe.granularity(role)
    # Jitted, one program: eagerly every step of the quantization compiled on its own.
    quantize = jax.jit(lambda v: quantize_operand(v, recipe.formats.forward, None, recipe,
                                                  role=role, transpose=transpose,
                                                  rows_are_tokens=role != "kernel"))  # fmt: skip
    q = quantize(_value((1, rows, k)))
    assert isinstance(q, QuantizedOperand) and q.granularity == declared and q.amax is None
    assert q.scale_inv.shape == (1, *declared.scale_shape(rows, k))
    assert q.has_transposed == transpose
    if transpose:  # its own scales, along the other axis
        assert q.transposed.scale_inv.shape == (1, *declared.scale_shape(k, rows))


def test_mx_operands_scales_are_powers_of_two_that_e8m0_holds():
    q = quantize_operand(_value((1, 64, 256)) * 1e3, fp8jax.E4M3, None, fp8jax.MXFP8Scaling(),
                         role="kernel")  # fmt: skip
    s = np.asarray(q.scale_inv, np.float64)
    assert q.granularity.power_of_two and s.shape == (1, 64, 256 // 32)
    np.testing.assert_array_equal(np.exp2(np.round(np.log2(s))), s)
    np.testing.assert_array_equal(np.asarray(q.scale_inv.astype(jnp.float8_e8m0fnu), np.float64), s)


def test_fine_operands_refuse_what_has_no_meaning_at_their_granularity():
    x, block = _value((1, 256, 256)), fp8jax.BlockScaling()
    with pytest.raises(ValueError, match=r"needs the operand's role=.*got role=None"):
        quantize_operand(x, fp8jax.E4M3, None, block)
    with pytest.raises(ValueError, match=r"no state, rows_ndim.*column_sums=True"):
        quantize_operand(x, fp8jax.E4M3, None, block, role="x", column_sums=True)
    with pytest.raises(ValueError, match=r"per block, got Granularity\(kind='block'.*=True"):
        quantize_operand(x, fp8jax.E4M3, None, block, role="kernel", transpose=True)


def test_per_tensor_recipes_declare_one_scale_for_every_role():
    for recipe in (fp8jax.CurrentScaling(), fp8jax.DelayedScaling()):
        assert [recipe.granularity(r) for r in ("x", "kernel", "grad")] == [PER_TENSOR] * 3
    with pytest.raises(ValueError, match=r"role must be one of \('x', 'kernel', 'grad'\), got 'w'"):
        fp8jax.CurrentScaling().granularity("w")


def test_a_recomputed_value_needs_delayed_scaling_alone():
    value = Recomputed(jnp.tanh, _value((8, 16)), (), jnp.bfloat16)
    with pytest.raises(ValueError, match="state=None"):
        quantize_operand(value, fp8jax.E4M3, None, fp8jax.CurrentScaling())
    with pytest.raises(ValueError, match="rows_ndim, got None"):
        quantize_operand(_value((8, 16)), fp8jax.E4M3, None, fp8jax.CurrentScaling(),
                         transpose=True)  # fmt: skip

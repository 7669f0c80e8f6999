"""fp8jax.ops.operand and fp8jax.ops.quantizing: one quantized-operand type from one entry point."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.ops.operand import PER_TENSOR, Granularity, QuantizedOperand
from fp8jax.ops.quantizing import Recomputed, quantize_operand


def _value(shape):
    return (jax.random.normal(jax.random.key(0), shape) * 3).astype(jnp.bfloat16)


def _bytes(a):
    return np.asarray(a.astype(jnp.float32))


def test_the_cast_kernel_writes_the_transposed_copy_of_the_same_bytes():
    # 256 x 128 fills the cast kernel's tiles; on the CPU its XLA twin runs.
    recipe = fp8jax.CurrentScaling()
    value = _value((2, 128, 128))
    both = quantize_operand(value, fp8jax.E4M3, None, recipe, rows_ndim=2, transpose=True)
    plain = quantize_operand(value, fp8jax.E4M3, None, recipe)
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
        q = quantize_operand(value, fp8jax.E5M2, None, recipe, rows_ndim=1, transpose=True,
                             column_sums=True)  # fmt: skip
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
    assert Granularity("block", 128).scale_shape(64, 300) == (64, 3)
    with pytest.raises(ValueError, match="kind must be one of"):
        Granularity("column")
    with pytest.raises(ValueError, match="an int > 0 for kind='block'"):
        Granularity("block")
    with pytest.raises(ValueError, match="an int > 0 for kind='block'"):
        Granularity("row", 128)


def test_a_recomputed_value_needs_delayed_scaling_alone():
    value = Recomputed(jnp.tanh, _value((8, 16)), (), jnp.bfloat16)
    with pytest.raises(ValueError, match="state=None"):
        quantize_operand(value, fp8jax.E4M3, None, fp8jax.CurrentScaling())
    with pytest.raises(ValueError, match="rows_ndim, got None"):
        quantize_operand(_value((8, 16)), fp8jax.E4M3, None, fp8jax.CurrentScaling(),
                         transpose=True)  # fmt: skip

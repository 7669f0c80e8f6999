"""docs/flax.md's examples run as written; fp8jax.flax's docstring examples run."""

import doctest
import importlib
import pathlib
import re

import jax
import numpy as np
import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "flax.md"

MODULES = [
    "fp8jax.flax.checkpoint",
    "fp8jax.flax.dot_general",
    "fp8jax.flax.rotary",
    "fp8jax.flax.train",
    "fp8jax.flax.linen.attention",
    "fp8jax.flax.linen.dense",
    "fp8jax.flax.linen.mlp",
    "fp8jax.flax.linen.moe",
    "fp8jax.flax.linen.norm",
    "fp8jax.flax.linen.transformer",
    "fp8jax.flax.nnx.attention",
    "fp8jax.flax.nnx.dense",
    "fp8jax.flax.nnx.mlp",
    "fp8jax.flax.nnx.moe",
    "fp8jax.flax.nnx.norm",
    "fp8jax.flax.nnx.train",
    "fp8jax.flax.nnx.transformer",
]


def test_docs_examples_run_and_learn():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 5
    namespace: dict = {}
    # Users run with JAX's standard promotion: optax.adam mixes its int32 count
    # with f32, and JAX's bf16 attention backward lowers through mixed dtypes.
    with jax.numpy_dtype_promotion("standard"):
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), namespace)
    assert namespace["losses"][-1] < 0.5 * namespace["losses"][0]
    assert namespace["nnx_losses"][-1] < 0.5 * namespace["nnx_losses"][0]
    assert float(namespace["qkv_scales"].x.scale) != 1.0
    # The MoE layers' example: one aux loss per scanned layer, near 1 (balanced) at init.
    aux = np.asarray(namespace["moe_aux"])
    assert aux.shape == (2,) and np.all((aux > 0.5) & (aux < 2))
    assert namespace["nnx_moe"].moe.aux_loss[...] > 0
    fp8, bf16 = namespace["fp8_out"], namespace["bf16_out"]
    assert np.linalg.norm(fp8 - bf16) / np.linalg.norm(bf16) < 0.08


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    with jax.numpy_dtype_promotion("standard"):  # as users run them (optax, see above)
        result = doctest.testmod(
            module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        )
    assert result.attempted > 0, f"{name} has no runnable example"
    assert result.failed == 0

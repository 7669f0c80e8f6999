"""docs/sharding.md and the README's Sharding section run as written; so do the doctests."""

import doctest
import pathlib
import re

import jax
import numpy as np
import pytest

import fp8jax.sharding

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "sharding.md"


def _blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def _run(blocks, namespace, path=DOC):
    # Users run with JAX's standard promotion (optax.adam; JAX's bf16 attention backward).
    with jax.numpy_dtype_promotion("standard"):
        for block in blocks:
            exec(compile(block, str(path), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def quick_start():
    """The quick start's namespace, run once for the tests below."""
    return _run([_blocks(DOC)[0]], {})


def test_quick_start_trains_sharded(quick_start):
    losses = quick_start["losses"]
    assert losses[-1] < 0.5 * losses[0]
    kernel = quick_start["state"].params["mlp"]["kernel_1"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", None, "tp")
    namespace = _run([_blocks(DOC)[2]], dict(quick_start))  # the shard_map recipe line
    assert namespace["recipe"].amax_reduction_axes == ("dp",)


@pytest.mark.deviceless
def test_the_proof_block_finds_fp8_gemms_and_gathers(quick_start):
    namespace = _run([_blocks(DOC)[1]], dict(quick_start))
    gathered = {
        c.dtype
        for c in namespace["report"].collectives
        if c.kind == "all-gather" and len(c.shape) > 1
    }
    # Combined gathers list several dtypes; each holds an FP8 one.
    assert gathered and all("f8e" in dtype for dtype in gathered), gathered


def test_readme_sharding_example_runs():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Sharding") : text.index("## Proving the GEMMs are FP8")]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    namespace = _run([block], {}, ROOT / "README.md")
    assert namespace["y"].shape == (8, 32, 64)
    assert np.isfinite(np.asarray(namespace["y"])).all()


def test_docstring_examples_run():
    result = doctest.testmod(
        fp8jax.sharding, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    assert result.attempted > 0 and result.failed == 0

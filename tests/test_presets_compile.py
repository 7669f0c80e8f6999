"""The GPU presets' train step compiles for an H100, every block GEMM in FP8.

``fp8jax train --config small|medium`` runs only on a GPU, so without this a
preset whose shapes XLA or the FP8 ops reject would first fail there. One
deviceless compile per preset, of the step ``fp8jax train`` jits, on abstract
parameters (nothing is allocated), with the layer scan kept a loop
(``--rolled-layers``): the same layer shapes, one body to compile. The four
compiles run in one child process (``verify.compile_many``), which starts JAX
and the CUDA plugin once.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from fp8jax.flax import TrainState, make_train_step
from fp8jax.models import Gpt, next_token_loss
from fp8jax.recipes import DelayedScaling
from fp8jax.training.config import TrainOptions, resolve


def _step(name: str, recipe: str, unroll_layers: bool, **overrides):
    """(the run's config, its train step, abstract (state, batch)) for an H100 compile.

    ``overrides`` replace fields of the preset's model (``layers``, to keep a
    compile cheap) and of the run (``batch_size``, ``seq_len``).
    """
    run = {k: overrides.pop(k) for k in ("batch_size", "seq_len") if k in overrides}
    config = resolve(TrainOptions(out="unused", config=name, recipe=recipe, **run))
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, **overrides))
    fp8_recipe = config.fp8_recipe()
    model = Gpt(
        config=config.model,
        precision=config.precision,
        recipe=fp8_recipe,
        # "auto" picks cuDNN on a GPU, which a deviceless compile cannot
        # load; the GEMMs around the attention core are the same.
        attention_implementation="xla",
        unroll_layers=unroll_layers,
    )
    tx = config.optimizer()
    tokens = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32)

    def create(key):
        variables = nn.meta.unbox(model.init(key, jnp.zeros(tokens.shape, tokens.dtype)))
        return TrainState.create(variables, tx)

    def loss(variables, batch):
        return next_token_loss(model.apply(variables, batch[:, :-1]), batch[:, 1:])

    state = jax.eval_shape(create, jax.random.key(0))
    delayed = fp8_recipe if isinstance(fp8_recipe, DelayedScaling) else None
    step = make_train_step(loss, tx, recipe=delayed)
    batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)
    return config, step, (state, batch)


GPU_PRESETS = [("small", "current"), ("medium", "delayed")]
LLAMA_PRESETS = [("llama-1b", "current"), ("llama-3b", "delayed")]
# The Llama presets' layer shapes (GQA, head_dim 64 and 128, ffn 8192) with two
# layers and one short sequence: the same GEMMs per layer, a cheap compile.
LLAMA_OVERRIDES = {"layers": 2, "batch_size": 1, "seq_len": 512}


@pytest.fixture(scope="module")
def compiled():
    """``{(preset, recipe): (config, GEMM report)}``, every step compiled for an H100."""
    from fp8jax.verify import compile_many, gemm_report

    steps = {p: _step(*p, unroll_layers=False) for p in GPU_PRESETS}
    steps |= {p: _step(*p, unroll_layers=False, **LLAMA_OVERRIDES) for p in LLAMA_PRESETS}
    with jax.numpy_dtype_promotion("standard"):
        hlos = compile_many([(step, args) for _, step, args in steps.values()], target="h100")
    return {
        preset: (config, gemm_report(hlo))
        for (preset, (config, _, _)), hlo in zip(steps.items(), hlos, strict=True)
    }


@pytest.mark.deviceless
@pytest.mark.parametrize(("name", "recipe"), GPU_PRESETS)
def test_gpu_preset_step_compiles_with_every_block_gemm_in_fp8(name, recipe, compiled):
    _, report = compiled[name, recipe]
    _assert_every_block_gemm_fp8(report)


@pytest.mark.deviceless
@pytest.mark.parametrize(("name", "recipe"), LLAMA_PRESETS)
def test_llama_preset_step_compiles_with_every_block_gemm_in_fp8(name, recipe, compiled):
    config, report = compiled[name, recipe]
    assert config.model.kv_heads == 8 and config.model.ffn == 8192
    _assert_every_block_gemm_fp8(report)


def _assert_every_block_gemm_fp8(report):
    # XLA may peel or split a loop body's GEMMs (medium's forward ones appear
    # two or three times), so the check is by source, not by count: every GEMM
    # of a transformer block outside the attention core is FP8.
    block = [g for g in report.gemms if "/blocks/" in g.op_name and "vmap(" not in g.op_name]
    assert block and all(g.is_fp8 for g in block), [g for g in block if not g.is_fp8]
    for projection in ("attention/qkv/", "attention/out/", "layer/mlp/"):
        forward = [g for g in block if projection in g.op_name and "transpose(" not in g.op_name]
        backward = [g for g in block if projection in g.op_name and "transpose(" in g.op_name]
        assert forward and len(backward) >= 2, projection  # dgrad and wgrad
    assert {(g.lhs_dtype, g.rhs_dtype) for g in report.fp8_gemms} == {
        ("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2"),
    }  # fmt: skip

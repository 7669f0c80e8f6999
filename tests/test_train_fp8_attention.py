"""``fp8jax train --attention fp8``: the train step with fp8jax's FP8 attention core.

A one-layer model with head_dim 64 (GQA 2:1) over sequences of 128 bytes,
the smallest shape the FP8 attention takes, on the CPU (its XLA twin).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.models import GptConfig
from fp8jax.training import TrainOptions
from fp8jax.training.config import resolve
from fp8jax.training.loop import _check_options
from fp8jax.training.program import TrainProgram

SEQ = 128
MODEL = GptConfig(hidden=128, layers=1, heads=2, kv_heads=1, ffn=128)


def first_loss(attention: str) -> float:
    config = resolve(TrainOptions(out="unused", seq_len=SEQ, attention=attention))
    config = dataclasses.replace(config, model=MODEL)
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, 256, (2, SEQ + 1)), jnp.int32)
    with jax.numpy_dtype_promotion("standard"):  # as fp8jax train: optax mixes int32 and f32
        prog = TrainProgram(config, None, attention)
        assert prog.model.attention_implementation == attention
        _, loss = jax.jit(prog.raw_step)(prog.initial_state, batch)
    return float(loss)


def test_train_step_with_fp8_attention_matches_bf16_attention_closely():
    """Same initial weights and batch: the first loss moves by attention's FP8 rounding only."""
    _check_options(TrainOptions(out="unused", attention="fp8"))  # accepted
    fp8, xla = first_loss("fp8"), first_loss("xla")
    assert np.isfinite(fp8)
    # The loss (about ln 256 at initialization) differs far less than E4M3's 2**-4.
    assert abs(fp8 - xla) <= 2**-4 * abs(xla) and fp8 != xla, (fp8, xla)


def test_unknown_attention_is_refused():
    from fp8jax.training.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--attention must be one of .*'fp8'"):
        _check_options(TrainOptions(out="unused", attention="fp16"))

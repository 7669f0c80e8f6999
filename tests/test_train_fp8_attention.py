"""``fp8jax train --attention fp8``: the train step with fp8jax's FP8 attention core.

A one-layer model with head_dim 64 (GQA 2:1) over sequences of 128 bytes,
the smallest shape the FP8 attention takes, on the CPU (its XLA twin).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.models import Gpt, GptConfig
from fp8jax.training import TrainOptions
from fp8jax.training.config import resolve
from fp8jax.training.loop import _check_options
from fp8jax.training.program import TrainProgram

# The three TrainPrograms (one model, FP8) compile the same initial-state program:
# through the module's compilation cache, the later two load it instead.
pytestmark = pytest.mark.usefixtures("shared_compile_cache")

SEQ = 128
MODEL = GptConfig(hidden=128, layers=1, heads=2, kv_heads=1, ffn=128)


@functools.cache  # each attention's loss serves several tests
def first_loss(attention: str) -> float:
    config = resolve(TrainOptions(out="unused", seq_len=SEQ, attention=attention))
    config = dataclasses.replace(config, model=MODEL)
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, 256, (2, SEQ + 1)), jnp.int32)
    with jax.numpy_dtype_promotion("standard"):  # as fp8jax train: optax mixes int32 and f32
        prog = TrainProgram(config, None, attention)
        hadamard = attention == "fp8-hadamard"
        assert prog.model.attention_implementation == ("fp8" if hadamard else attention)
        assert prog.model.attention_hadamard is hadamard and prog.attention == attention
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


def test_train_step_with_hadamard_fp8_attention_rotates_and_matches_bf16_closely():
    """``--attention fp8-hadamard``: the FP8 core with ``hadamard=True`` (another rounding)."""
    _check_options(TrainOptions(out="unused", attention="fp8-hadamard"))  # accepted
    rotated, fp8, xla = first_loss("fp8-hadamard"), first_loss("fp8"), first_loss("xla")
    assert abs(rotated - xla) <= 2**-4 * abs(xla) and rotated != fp8, (rotated, fp8, xla)


def test_gpt_refuses_hadamard_without_the_fp8_attention():
    with pytest.raises(ValueError, match=r"Gpt.attention_hadamard=True .* got 'cudnn'"):
        Gpt(config=MODEL, attention_implementation="cudnn", attention_hadamard=True)

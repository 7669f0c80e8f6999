"""``fp8jax train --attention fp8``: the train step with fp8jax's FP8 attention core.

A one-layer model with head_dim 64 (GQA 2:1) over sequences of 128 bytes,
the smallest shape the FP8 attention takes, on the CPU (its XLA twin).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.flax import linen as fnn
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


# The attention's output, compared where the two steps differ only in the attention core
# (the same params and batch give the same QKV GEMM). The FP8 core rounds Q, K, V and P to
# E4M3, and each step's output projection rounds its own core output to E4M3 (the kernel's
# E4M3 copy is the same in both): six roundings that differ between the two. A rounding
# errs by 0.425 u relative RMS (u = 2**-4, mantissas log-uniform; tests/flax/flax_reference.py),
# k independent ones by sqrt(k) of that; 1.5 times that is the budget (0.097). A core whose
# output were 1.25 times or 0 times the right one errs by 0.25 or 1.
ATTENTION_BUDGET = 1.5 * math.sqrt(6) * math.sqrt(0.541 / 3) * 2.0**-4


def _is_attention(module, method) -> bool:
    return isinstance(module, fnn.MultiHeadAttention) and method == "__call__"


@functools.cache  # each attention's step serves several tests
def first_step(attention: str) -> tuple[float, np.ndarray]:
    """The first step's loss, and the layer's attention output at init."""
    config = resolve(TrainOptions(out="unused", seq_len=SEQ, attention=attention))
    config = dataclasses.replace(config, model=MODEL)
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, 256, (2, SEQ + 1)), jnp.int32)
    with jax.numpy_dtype_promotion("standard"):  # as fp8jax train: optax mixes int32 and f32
        prog = TrainProgram(config, None, attention)
        hadamard = attention == "fp8-hadamard"
        assert prog.model.attention_implementation == ("fp8" if hadamard else attention)
        assert prog.model.attention_hadamard is hadamard and prog.attention == attention
        state = prog.initial_state
        assert not state.fp8_state  # CurrentScaling: the params are the whole model state
        _, loss = jax.jit(prog.raw_step)(state, batch)
        _, sown = jax.jit(
            lambda p, x: prog.model.apply({"params": p}, x, capture_intermediates=_is_attention,
                                          mutable=["intermediates"])
        )(state.params, batch[:, :-1])  # fmt: skip
    # One call of the one (scanned) layer's attention: (its output, the residual it passes).
    ((attended, _),) = sown["intermediates"]["blocks"]["layer"]["attention"]["__call__"]
    return float(loss), np.asarray(attended, np.float64)


def attention_error(attention: str) -> float:
    got, want = first_step(attention)[1], first_step("xla")[1]
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_train_step_with_fp8_attention_matches_bf16_attention_closely():
    """Same initial weights and batch: the attention moves by the FP8 core's rounding only.

    The loss at initialization is about ln 256 whatever the attention gives (a zero
    attention moves it by 0.2%), so the attention's output is compared instead.
    """
    _check_options(TrainOptions(out="unused", attention="fp8"))  # accepted
    fp8, xla = first_step("fp8")[0], first_step("xla")[0]
    assert np.isfinite(fp8) and fp8 != xla, (fp8, xla)
    error = attention_error("fp8")
    assert 0 < error < ATTENTION_BUDGET, error


def test_unknown_attention_is_refused():
    from fp8jax.training.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--attention must be one of .*'fp8'"):
        _check_options(TrainOptions(out="unused", attention="fp16"))


def test_train_step_with_hadamard_fp8_attention_rotates_and_matches_bf16_closely():
    """``--attention fp8-hadamard``: the FP8 core with ``hadamard=True`` (another rounding)."""
    _check_options(TrainOptions(out="unused", attention="fp8-hadamard"))  # accepted
    rotated, fp8 = first_step("fp8-hadamard")[1], first_step("fp8")[1]
    assert not np.array_equal(rotated, fp8)
    # The rotation is exact in real arithmetic: the same rounding budget.
    error = attention_error("fp8-hadamard")
    assert 0 < error < ATTENTION_BUDGET, error


def test_gpt_refuses_hadamard_without_the_fp8_attention():
    with pytest.raises(ValueError, match=r"Gpt.attention_hadamard=True .* got 'cudnn'"):
        Gpt(config=MODEL, attention_implementation="cudnn", attention_hadamard=True)

"""``fp8jax train``'s run options: --remat, --accumulation-steps, --profile, f32 master weights.

Each test builds the train step ``fp8jax train`` jits (TrainProgram) for a
one-layer model narrower than ``tiny`` (GQA, as the Llama presets), at 4-8
sequences of 32 bytes, on the CPU: the compiles are most of the time.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp8jax.models import GptConfig
from fp8jax.training import TrainOptions, train
from fp8jax.training.config import RunConfig, resolve
from fp8jax.training.program import TrainProgram

# The TrainPrograms of one model and precision compile the same initial-state program:
# through the module's compilation cache, the later ones load it instead.
pytestmark = pytest.mark.usefixtures("shared_compile_cache")

SEQ = 32
MODEL = GptConfig(hidden=64, layers=1, heads=4, kv_heads=2, ffn=128)


def program(**options) -> TrainProgram:
    config = resolve(TrainOptions(out="unused", seq_len=SEQ, **options))
    config = dataclasses.replace(config, model=MODEL)
    with jax.numpy_dtype_promotion("standard"):  # as fp8jax train: optax mixes int32 and f32
        prog = TrainProgram(config, None, "xla")
    prog.jitted_raw = jax.jit(prog.raw_step)  # not donated: a test reuses the initial state
    return prog


def tokens(batch: int, seed: int = 0) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, 256, (batch, SEQ + 1)), jnp.int32)


def step(prog: TrainProgram, batch):
    with jax.numpy_dtype_promotion("standard"):
        return prog.jitted_raw(prog.initial_state, batch)


def param_grads(prog: TrainProgram, batch):
    """The loss and its gradient with respect to the f32 parameters, as the step takes them.

    The FP8 state is differentiated too (its "gradient" is the next state), as
    in the train step.
    """
    state = prog.initial_state

    def loss(params, fp8_state):
        variables = {"params": params}
        if fp8_state:
            variables["fp8_state"] = fp8_state
        return prog.loss(variables, batch)

    with jax.numpy_dtype_promotion("standard"):
        value, (grads, _) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
            state.params, state.fp8_state
        )
    return value, grads


def relative_error(a, b) -> float:
    """||a - b|| / ||b|| over every leaf of two gradient trees.

    In numpy (f64): as eager JAX ops, each leaf's shape compiled three programs.
    """
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    diff = sum(float(np.sum((np.float64(x) - np.float64(y)) ** 2)) for x, y in pairs)
    norm = sum(float(np.sum(np.float64(y) ** 2)) for y in jax.tree.leaves(b))
    return (diff / norm) ** 0.5


def test_remat_recomputes_the_same_loss_and_gradients():
    batch = tokens(4)
    loss, grads = param_grads(program(recipe="delayed"), batch)
    for remat in ("dots", "full"):
        remat_loss, remat_grads = param_grads(program(recipe="delayed", remat=remat), batch)
        # The forward that the loss comes from is not recomputed: same to f32 rounding.
        assert abs(float(remat_loss) - float(loss)) <= 1e-6 * abs(float(loss)), remat
        # XLA may fuse the recomputed forward differently: one BF16 rounding
        # (2^-8) on some values, and such a value that lands across an E4M3
        # rounding boundary moves by one E4M3 step (2^-3 relative) in its cast.
        # A few percent of the casts doing so move the gradient by a small
        # fraction of that step: 2^-5 norm-wise.
        assert relative_error(remat_grads, grads) <= 2**-5, remat


def sgd_step(prog, batch):
    """Loss, gradients and new state of one train step whose optimizer is SGD with rate 1."""
    state, loss = step(prog, batch)
    # In numpy, as relative_error: the same f32 differences, no program per leaf shape.
    grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b),
                         prog.initial_state.params, state.params)  # fmt: skip
    return loss, grads, state


def newest_amaxes(fp8_state) -> list:
    """The newest amax (history slot 0) of every scale in ``fp8_state``."""
    leaves = jax.tree_util.tree_leaves_with_path(fp8_state)
    newest = [np.asarray(a)[..., 0] for path, a in leaves
              if "amax_history" in jax.tree_util.keystr(path)]  # fmt: skip
    return newest


def test_two_micro_batches_of_b_give_the_step_of_one_batch_of_2b(monkeypatch):
    monkeypatch.setattr(RunConfig, "optimizer", lambda self: optax.sgd(1.0))
    batch = tokens(8)
    loss, grads, _ = sgd_step(program(precision="bf16", batch_size=8), batch)
    acc_loss, acc_grads, _ = sgd_step(
        program(precision="bf16", batch_size=8, accumulation_steps=2), batch
    )
    # The loss is a mean of two equal-sized means: equal to f32 rounding.
    assert abs(float(acc_loss) - float(loss)) <= 1e-6 * abs(float(loss))
    # Each micro-batch's weight gradient leaves its BF16 GEMM rounded to 2^-9
    # relative before the two are summed in f32: a few BF16 roundings apart.
    # (In FP8 the micro-batches' gradients quantize differently from the whole
    # batch's, which is not an accumulation error.)
    assert relative_error(acc_grads, grads) <= 2**-6


def test_micro_batch_scale_states_are_merged_by_max(monkeypatch):
    monkeypatch.setattr(RunConfig, "optimizer", lambda self: optax.sgd(1.0))
    batch = tokens(8)
    whole = sgd_step(program(recipe="delayed", batch_size=8, accumulation_steps=2), batch)[2]
    half = program(recipe="delayed", batch_size=4)
    first, second = sgd_step(half, batch[:4])[2], sgd_step(half, batch[4:])[2]
    expected = newest_amaxes(jax.tree.map(np.maximum, first.fp8_state, second.fp8_state))
    newest = newest_amaxes(whole.fp8_state)
    assert len(newest) == 12  # x, kernel and grad of the 4 block GEMMs (layers stacked)
    for got, want in zip(newest, expected, strict=True):
        # Each micro-batch's amaxes are its own, as if it were a step of its own,
        # and the step keeps their maximum; amaxes are exact, so the equality is too.
        np.testing.assert_array_equal(got, want)


def test_parameters_and_adamw_moments_are_f32_master_weights():
    state = program(recipe="current").initial_state
    assert {p.dtype for p in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda n: hasattr(n, "mu"))
            if hasattr(s, "mu")]  # fmt: skip
    assert len(adam) == 1
    moments = jax.tree.leaves((adam[0].mu, adam[0].nu))
    assert moments and {m.dtype for m in moments} == {jnp.dtype(jnp.float32)}


def test_a_run_with_remat_accumulation_and_profile_trains_and_writes_a_trace(tmp_path):
    out, trace = tmp_path / "run", tmp_path / "trace"
    messages = []
    options = TrainOptions(
        out=str(out), recipe="delayed", remat="dots", accumulation_steps=2, profile=str(trace),
        batch_size=8, seq_len=SEQ, steps=4, log_every=2, eval_every=4, eval_batches=1,
        checkpoint_every=4, compile_cache="none",
    )  # fmt: skip
    result = train(options, progress=False, say=messages.append)
    assert result.status == "completed"
    assert list(trace.rglob("*.xplane.pb")), sorted(trace.rglob("*"))
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["remat"], summary["accumulation_steps"]) == ("dots", 2)
    assert np.isfinite(summary["final_val_loss"])
    # On a CPU there is no known peak: no MFU, and the output says so.
    assert summary["mfu"] is None and summary["mfu_peak_flops"] is None
    text = "\n".join(messages)
    assert "MFU n/a: no known BF16 peak for 'cpu'" in text
    assert "profile: steps 2-4 traced into" in text
    assert "in 2 micro-batches of 4, remat dots" in text
    # Issue 56, item 12: the count's extra dot_generals are the backward's recomputed ones.
    assert "--remat dots recomputes the attention core GEMMs in the backward" in text

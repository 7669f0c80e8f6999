"""bench/gpt.py on the CPU with the tiny preset: it times fp8jax train's own jitted step.

What the rows hold, never how fast they are.
"""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
import gpt as gpt_bench
import jax


def test_each_variant_times_the_train_step_fp8jax_train_jits(tmp_path):
    out = tmp_path / "gpt.json"
    program, step, _, tokens, devices = gpt_bench.step_and_args(
        "tiny", "fp8jax_delayed", batch_size=2, seq_len=32
    )
    # The step is TrainProgram's own jit (compiler options, donation), not a re-jit.
    assert step is program.step and (tokens, devices) == (64, 1)
    names = ["bf16", "fp8jax_current", "fp8jax_delayed"]
    argv = ["--config", "tiny", "--variants", *names, "--iters", "2",
            "--heat", "0", "--batch-size", "2", "--seq-len", "32", "--out", str(out)]  # fmt: skip
    rows = gpt_bench.main(argv)
    assert [r["name"] for r in rows] == names
    saved = json.loads(out.read_text())
    assert [r["name"] for r in saved["rows"]] == names and not saved["failed"]
    for row in saved["rows"]:
        assert row["tokens_per_s"] > 0 and row["compile_s"] > 0 and row["batch"] == [2, 32]
        assert row["model_flops_per_token"] > 0
        # A CPU has no known BF16 peak: no MFU, and the row says why.
        assert row["mfu"] is None and row["mfu_text"].startswith("MFU n/a")
        assert "peak_memory_gib" in row
        # Every parameter's gradient, on the state the step is timed from, is not all zeros.
        params = len(jax.tree.leaves(program.initial_state.params))
        assert row["gradient_leaves_checked"] == params, row["name"]


def test_with_accumulation_the_gradients_checked_are_the_first_micro_batchs(monkeypatch):
    # The check's own backward runs on the step's micro-batch, not the whole
    # batch the step never holds at once.
    program, _, (state, batch), _, _ = gpt_bench.step_and_args(
        "tiny", "fp8jax_current", batch_size=4, seq_len=32, accumulation_steps=2
    )
    seen = []
    loss = program.loss
    monkeypatch.setattr(program, "loss", lambda v, b: seen.append(b.shape) or loss(v, b))
    with jax.numpy_dtype_promotion("standard"):  # as gpt.py runs it: optax mixes dtypes
        maxima = gpt_bench.step_gradients(program)(None, [state, batch])
    assert seen == [(2, batch.shape[1])]
    assert len(jax.tree.leaves(maxima)) == len(jax.tree.leaves(state.params))


def configs_seen(monkeypatch, module, name) -> list:
    """The ``config=`` of every call of ``module.name`` from now on (the call goes through)."""
    seen, wrapped = [], getattr(module, name)

    def spy(*args, config, **kwargs):
        seen.append(config)
        return wrapped(*args, config=config, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


def test_an_attention_build_reaches_the_fp8_attention_the_step_traces(monkeypatch):
    import jax.numpy as jnp
    import pytest

    import fp8jax
    from fp8jax.kernels import attention as kernel

    seen = configs_seen(monkeypatch, kernel, "forward")
    build = gpt_bench.forward_build("longest_first")
    assert build[1] is None  # no backward build named: the library's
    q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)

    def trace():
        jax.make_jaxpr(lambda x: fp8jax.dot_product_attention(x, x, x, causal=True))(q)

    with gpt_bench.attention_built_as(build):
        trace()
    trace()  # the library's own build again afterwards
    assert build[0] != kernel.DEFAULT_CONFIG and seen == [build[0], kernel.DEFAULT_CONFIG]
    assert gpt_bench.forward_build(None) is None
    with pytest.raises(SystemExit, match="longest_first.*got 'fastest'"):
        gpt_bench.forward_build("fastest")
    with pytest.raises(SystemExit, match="at most one forward build"):
        gpt_bench.forward_build("fa3,stages3")


def test_a_backward_attention_build_reaches_the_backward_the_step_traces(monkeypatch):
    import jax.numpy as jnp

    import fp8jax
    from fp8jax.kernels import attention_backward as kernels

    seen = configs_seen(monkeypatch, kernels, "backward")
    build = gpt_bench.forward_build("longest_first,bwd_fused")
    q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)

    def trace():
        loss = lambda x: fp8jax.dot_product_attention(x, x, x, causal=True).astype(float).sum()  # noqa: E731
        jax.make_jaxpr(jax.grad(loss))(q)

    with gpt_bench.attention_built_as(build):
        trace()
    trace()
    assert build[1].fused and seen == [build[1], kernels.DEFAULT_CONFIG]
    assert not kernels.DEFAULT_CONFIG.fused

"""fp8jax.training: a short tiny run learns and writes its run directory; resume, stops, mesh.

The runs use the tiny preset with a smaller batch and sequence (8 x 64 bytes)
to stay fast on two CPU cores; the default corpus (the stdlib's source) is
read as in a real run. The runs of one configuration share their compiled
programs through the module's persistent compilation cache
(``shared_compile_cache``, tests/conftest.py): compiling is most of a run's time.
"""

import json
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fp8jax import training
from fp8jax.training import TrainOptions, gemm_count, read_metrics, summary, train

pytestmark = pytest.mark.usefixtures("shared_compile_cache")

FAST = {
    "batch_size": 8,
    "seq_len": 64,
    "steps": 20,
    "log_every": 5,
    "eval_every": 10,
    "eval_batches": 2,
    "checkpoint_every": 10,
}


def options(out, **overrides) -> TrainOptions:
    return TrainOptions(out=str(out), **(FAST | overrides))


def checkpoint_arrays(run: pathlib.Path, step: int) -> dict:
    """Checkpoint ``step`` as numpy arrays, read without a template."""
    restored = ocp.StandardCheckpointer().restore(
        (run / "checkpoints" / str(step) / "default").absolute()
    )
    return {
        jax.tree_util.keystr(p): np.asarray(v)
        for p, v in jax.tree_util.tree_leaves_with_path(restored)
    }


@pytest.fixture(scope="module")
def delayed_run(tmp_path_factory):
    """An uninterrupted 20-step FP8 run with delayed scaling (FP8 state in its checkpoints)."""
    out = tmp_path_factory.mktemp("runs") / "tiny-fp8-delayed"
    messages = []
    result = train(options(out, recipe="delayed"), progress=False, say=messages.append)
    return out, result, messages


def test_a_short_tiny_run_lowers_the_loss_and_writes_its_run_directory(delayed_run):
    out, result, messages = delayed_run
    assert result.status == "completed" and result.step == 20
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [5, 10, 15, 20]  # one line per log step
    assert [m["step"] for m in metrics if "val_loss" in m] == [10, 20]
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 1.0  # from ~5 nats/byte
    assert metrics[-1]["val_loss"] < 4.0
    assert all(m["tokens_per_s"] > 0 and m["step_time_s"] > 0 for m in metrics)
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [10, 20]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_val_loss"] == metrics[-1]["val_loss"]
    # 4 block GEMMs x (forward + 2 backward) in FP8; attention core and LM head in BF16.
    assert summary["fp8_gemms"]["jaxpr"]["fp8"] == 12
    assert summary["fp8_gemms"]["jaxpr"]["total"] == 23
    config = json.loads((out / "config.json").read_text())
    assert (config["precision"], config["recipe"], config["name"]) == ("fp8", "delayed", "tiny")
    assert config["data"]["fingerprint"]
    text = "\n".join(messages)
    assert "12 of 23 dot_generals are FP8" in text and "completed at step 20/20" in text


def test_an_interrupted_then_resumed_run_matches_the_uninterrupted_one_bitwise(
    delayed_run, tmp_path
):
    reference, _, _ = delayed_run
    out = tmp_path / "run"

    def ctrl_c_at_7(step):
        if step == 7:
            raise KeyboardInterrupt

    first = train(options(out, recipe="delayed"), progress=False, on_step=ctrl_c_at_7, say=print)
    assert first.status == "interrupted" and first.step == 7
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [7]
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"

    second = train(options(out, recipe="delayed", resume=True), progress=False, say=print)
    assert second.status == "completed" and second.step == 20
    # Batches are a function of (seed, step), and params, AdamW moments, its step count and
    # the FP8 amax histories all round-trip exactly: the resumed run is the same computation.
    want, got = checkpoint_arrays(reference, 20), checkpoint_arrays(out, 20)
    assert want.keys() == got.keys()
    assert any("fp8_state" in k for k in got)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    by_step = {m["step"]: m for m in read_metrics(reference / "metrics.jsonl")}
    resumed = {m["step"]: m for m in read_metrics(out / "metrics.jsonl")}
    assert sorted(resumed) == [5, 10, 15, 20]
    # Step 10's line averages steps 8-10 only (the window restarts on resume); 15 and 20 match.
    for step in (15, 20):
        assert resumed[step]["loss"] == by_step[step]["loss"]
    for step in (10, 20):
        assert resumed[step]["val_loss"] == by_step[step]["val_loss"]


def test_a_nan_loss_stops_training_and_keeps_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "run"
    # delayed_run's configuration, so its compiled programs serve (the NaN is put into the
    # parameters outside the step); its checkpoint then holds FP8 state, checked finite too.
    with pytest.raises(training.DivergedError) as e:
        train(options(out, recipe="delayed", inject_nan_at=13), progress=False, say=print)
    message = str(e.value)
    assert "the loss is nan at step 13" in message
    assert "last good checkpoint, step 10, is kept" in message and "--resume" in message
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [10]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["diverged_at"] == 13
    assert summary["checkpoint_step"] == 10
    # The kept checkpoint is finite, and the metrics stop before the NaN.
    assert all(np.isfinite(a).all() for a in checkpoint_arrays(out, 10).values())
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [5, 10]


def test_fsdp_and_dp_mesh_shards_params_and_batch(tmp_path):
    out = tmp_path / "run"
    opts = options(out, mesh="dp=2,fsdp=2", steps=2, log_every=1, eval_every=2, eval_batches=1)
    result = train(opts, progress=False, say=print)
    assert result.status == "completed"
    assert result.summary["mesh"] == {"dp": 2, "fsdp": 2}
    metrics = read_metrics(out / "metrics.jsonl")
    assert len(metrics) == 2 and np.isfinite([m["loss"] for m in metrics]).all()
    manager = ocp.CheckpointManager(
        (out / "checkpoints").absolute(), item_handlers=ocp.StandardCheckpointHandler()
    )
    saved = manager.item_metadata(2).tree
    # Params and their AdamW moments are split over fsdp along the model width ("embed").
    for tree in (saved["params"], saved["opt_state"][1][0]["mu"]):
        assert tuple(tree["embed"]["embedding"].sharding.partition_spec) == (None, "fsdp")
        spec = tree["blocks"]["layer"]["mlp"]["kernel_2"].sharding.partition_spec
        assert tuple(spec) == (None, None, "fsdp")  # (layers, mlp, embed)
    manager.close()


def test_the_deviceless_report_is_skipped_without_the_toolchain(monkeypatch):
    from fp8jax.verify import toolchain

    def missing():
        raise ImportError("jax-cuda13-plugin is not installed (test)")

    monkeypatch.setattr(toolchain, "check_deviceless", missing)
    x = jax.numpy.ones((16, 16), jax.numpy.bfloat16)
    counts = gemm_count.deviceless_counts(jax.numpy.dot, x, x, target="h100", mesh=None)
    assert counts == {
        "target": "h100",
        "skipped": "fp8jax[verify] is not installed: jax-cuda13-plugin is not installed (test)",
    }
    assert summary.deviceless_text(counts).startswith("h100 compile: skipped (fp8jax[verify]")


def test_a_live_count_on_a_machine_without_a_gpu_is_skipped_with_the_reason():
    x = jax.numpy.ones((16, 16), jax.numpy.bfloat16)
    counts = gemm_count.deviceless_counts(jax.numpy.dot, x, x, target="live", mesh=None)
    assert counts["target"] == "live"
    assert counts["skipped"].startswith("compile failed: RuntimeError: target='live' compiles")
    assert "jax.default_backend() is 'cpu'" in counts["skipped"]


@pytest.fixture(scope="module")
def fsdp_h100_compiles():
    """``{precision: (config, GEMM report)}``: the --mesh fsdp=2 train step for two H100s.

    Both precisions compile in one child process (``verify.compile_many``), which
    starts JAX and the CUDA plugin once for the two compiles.
    """
    from fp8jax import verify
    from fp8jax.training import loop
    from fp8jax.training import mesh as mesh_lib

    precisions = ("fp8", "bf16")
    configs = [
        training.config.resolve(
            options("unused", mesh="fsdp=2", precision=p, batch_size=4, seq_len=64)
        )
        for p in precisions
    ]
    hidden = configs[0].model.hidden
    mesh = mesh_lib.build_mesh({"fsdp": 2}, batch_size=4, hidden=hidden)
    calls = []
    with jax.numpy_dtype_promotion("standard"):
        for config in configs:
            assert config.model.hidden == hidden  # one mesh serves both
            program = loop.TrainProgram(config, mesh, "xla")
            batch = program.put(np.zeros((4, 65), np.int32))
            abstract = (gemm_count._abstract(program.initial_state), gemm_count._abstract(batch))
            calls.append((program.raw_step, abstract))
        no_combining = " ".join(
            f"--xla_gpu_{k}_combine_threshold_bytes=0" for k in ("all_gather", "all_reduce")
        )
        with program.sharding_context():  # the mesh's; the same for both programs
            hlos = verify.compile_many(calls, target="h100", devices=2, xla_flags=no_combining)
    reports = [verify.gemm_report(hlo) for hlo in hlos]
    return dict(zip(precisions, zip(configs, reports, strict=True), strict=True))


@pytest.mark.deviceless
@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_an_fsdp_train_step_gathers_weights_and_never_all_reduces_activations(
    precision, fsdp_h100_compiles
):
    """--mesh fsdp=2 compiled for two H100s: the collectives FSDP should have, and no others.

    Regression test: before the step was traced under fp8jax.sharding's rules,
    XLA split the GEMMs along the hidden axis and all-reduced BF16 activations
    (77 ms a step on two H200s for ``medium``) instead of gathering weights.
    """
    import math

    config, report = fsdp_h100_compiles[precision]
    c = config.model
    # The layers are unrolled when compiled (Gpt.unroll_layers): every layer's GEMMs appear.
    assert len(report.fp8_gemms) == (12 * c.layers if precision == "fp8" else 0)
    gathered = {}
    for row in report.collectives:
        # Allowed: the partial maxima of an amax, and vectors (norm scale gradients).
        if row.kind == "all-reduce":
            amax_partials = row.op_name.endswith("reduce_max")
            assert amax_partials or math.prod(row.shape) <= c.ffn, (row.dtype, row.shape)
        if row.kind == "all-gather" and len(row.shape) >= 2:
            gathered[row.dtype] = gathered.get(row.dtype, 0) + math.prod(row.shape)
    # Each block kernel is gathered once, in every layer: with the layers unrolled XLA keeps
    # the gathered kernel from the forward to the backward (a rolled scan gathered it again).
    block_kernels = c.layers * (4 * c.hidden * c.hidden + 3 * c.hidden * c.ffn)
    embed_and_head = 2 * 256 * c.hidden  # BF16 by design, gathered once
    if precision == "fp8":
        assert gathered == {"f8e4m3fn": block_kernels, "bf16": embed_and_head}
    else:
        assert gathered == {"bf16": block_kernels + embed_and_head}


def test_logging_stays_out_of_the_timed_steps_and_the_summary_says_which_steps(
    tmp_path, monkeypatch
):
    # Issue 56, item 16: the learning rate logged at step 5 ran eager JAX ops, compiled on
    # their first call (about 1 s on a GPU), inside the timing of steps 6-10. A fake clock
    # that jumps 1000 s whenever the loop asks for the learning rate finds any such leak.
    from fp8jax.training import config as training_config
    from fp8jax.training import progress

    offset = [0.0]
    real = progress.time.perf_counter
    monkeypatch.setattr(progress, "time", type("Clock", (), {
        "perf_counter": staticmethod(lambda: real() + offset[0]),
    }))  # fmt: skip
    schedule = training_config.RunConfig.schedule

    def slow_schedule(self):
        inner = schedule(self)

        def lr(count):
            if isinstance(count, int):  # the loop's call, not the optimizer's traced one
                offset[0] += 1000.0
            return inner(count)

        return lr

    monkeypatch.setattr(training_config.RunConfig, "schedule", slow_schedule)
    out = tmp_path / "run"
    train(options(out, steps=10, precision="bf16"), progress=False, say=lambda _: None)
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [5, 10]
    assert all(m["step_time_s"] < 100 for m in metrics), metrics
    result = json.loads((out / "summary.json").read_text())
    assert result["tokens_per_s_steps"] == [2, 10]
    assert "first step" in result["tokens_per_s_excludes"]
    assert "(steps 2-10)" in summary.text(result, out)


# XLA's words when a buffer does not fit (a GPU's allocator); raised here by a stand-in step,
# since a real out-of-memory on the CPU would take the machine's memory.
XLA_OOM = (
    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 40802189312 bytes.\n"
    "BufferAssignment OOM Debugging.\nBufferAssignment stats: ..."
)


class _OutOfMemoryAt:
    """A TrainProgram whose jitted step raises XLA's out-of-memory error at one step."""

    def __init__(self, step: int, message: str = XLA_OOM):
        self.step, self.message = step, message

    def patch(self, monkeypatch):
        from fp8jax.training import loop

        fail_at, message = self.step, self.message

        class Program(loop.TrainProgram):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                step, calls = self.step, [0]

                def failing(state, batch):
                    calls[0] += 1
                    if calls[0] == fail_at:
                        raise jax.errors.JaxRuntimeError(message)
                    return step(state, batch)

                self.step = failing

        monkeypatch.setattr(loop, "TrainProgram", Program)


def test_out_of_memory_names_the_options_that_shrink_the_step(tmp_path, monkeypatch):
    _OutOfMemoryAt(3).patch(monkeypatch)
    out = tmp_path / "run"
    opts = options(out, recipe="delayed", steps=5, log_every=5, eval_every=5)
    with pytest.raises(training.OutOfMemoryError) as e:
        train(opts, progress=False, say=print)
    message = str(e.value)
    assert "out of device memory while running step 3 of tiny (fp8)" in message
    assert "Out of memory while trying to allocate 40802189312 bytes." in message
    assert "BufferAssignment" not in message  # XLA's first line only, not its buffer dump
    for option in ("--batch-size (the run has 8)", "--seq-len (it has 64)",
                   "--accumulation-steps N", "--remat dots or full", "fsdp"):  # fmt: skip
        assert option in message
    assert e.value.exit_code == 1
    record = json.loads((out / "summary.json").read_text())
    assert record["status"] == "out_of_memory" and record["error"] == message


def test_other_xla_runtime_errors_are_not_called_out_of_memory(tmp_path, monkeypatch):
    _OutOfMemoryAt(1, "INTERNAL: cuBLASLt failed").patch(monkeypatch)
    opts = options(tmp_path / "run", recipe="delayed", steps=2, log_every=2, eval_every=2)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: cuBLASLt failed"):
        train(opts, progress=False, say=print)


def test_out_of_memory_while_initializing_names_the_options(tmp_path, monkeypatch):
    from fp8jax.training import loop

    def no_room(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(XLA_OOM)

    monkeypatch.setattr(loop, "TrainProgram", no_room)
    opts = options(tmp_path / "run", steps=2, mesh="fsdp=2", remat="full")
    with pytest.raises(training.OutOfMemoryError) as e:
        train(opts, progress=False, say=print)
    message = str(e.value)
    where = "on the mesh {'dp': 1, 'fsdp': 2}"
    assert f"while initializing the parameters of tiny (fp8) {where}" in message
    # The run already uses full remat and fsdp: those are not offered again.
    assert "--remat" not in message and "a mesh with fsdp" not in message
    assert "--batch-size (the run has 8)" in message

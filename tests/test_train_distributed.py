"""``fp8jax train`` on several processes: how they join, what each loads, and a real 2-process run.

The run test starts the command twice, as two processes of 4 CPU devices that
meet at a coordinator on 127.0.0.1 (Gloo carries their collectives), and checks
their losses and final parameters against this process training the same
global batches on its 8 devices with the same mesh. It then resumes the
two-process run in this one process (a different process count) and checks it
against the single-process run continued as far.
"""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import cpu_compile
from fp8jax import data
from fp8jax.training import ConfigError, TrainOptions, read_metrics, train
from fp8jax.training import distributed as dist
from fp8jax.training import mesh as mesh_lib

SLURM = {
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
}


@pytest.mark.parametrize(
    ("args", "environ", "expected"),
    [
        ((None, None, None), {}, dist.Launch("single")),
        (("h:1", 2, 1), {}, dist.Launch("options", "h:1", 2, 1)),
        ((None, 2, 0), {"JAX_COORDINATOR_ADDRESS": "h:9"}, dist.Launch("options", "h:9", 2, 0)),
        (("h:1", 1, 0), {}, dist.Launch("single")),
        ((None, None, None), SLURM | {"SLURM_NTASKS": "4"}, dist.Launch("slurm")),
        ((None, None, None), SLURM | {"SLURM_NTASKS": "1"}, dist.Launch("single")),
        (
            (None, None, None),
            {"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"},
            dist.Launch("ompi"),
        ),
    ],
)
def test_the_launch_comes_from_the_options_or_the_cluster(args, environ, expected):
    assert dist.plan(*args, environ=environ) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((None, 2, 0), "--coordinator-address missing"),
        (("h:1", 2, None), "--process-id missing"),
        (("h:1", 2, 2), "--process-id must be below --num-processes (2), got 2"),
        (("h:1", 0, 0), "--num-processes must be an int >= 1, got 0"),
        (("nohost", 2, 0), "'host:port'"),
        # jax.distributed.initialize segfaulted on a port that is no number.
        (("localhost:abc", 2, 0), "a port from 1 to 65535), got 'localhost:abc'"),
        (("localhost:65536", 2, 0), "'host:port'"),
        ((":1234", 2, 0), "'host:port'"),
        (("h:1", None, None), "without --num-processes and --process-id"),
    ],
)
def test_incomplete_launch_options_are_refused_with_the_missing_one(args, message):
    with pytest.raises(ConfigError) as info:
        dist.plan(*args, environ={})
    assert message in str(info.value)


def test_each_process_loads_its_rows_of_the_same_batches():
    stream = np.arange(1000, dtype=np.uint8)
    whole = data.train_batch(stream, 3, batch_size=8, seq_len=16, seed=1)
    part = data.train_batch(stream, 3, batch_size=8, seq_len=16, seed=1, rows=slice(4, 8))
    np.testing.assert_array_equal(part, whole[4:8])
    val = data.validation_batches(stream, batches=2, batch_size=8, seq_len=16)
    val_part = data.validation_batches(
        stream, batches=2, batch_size=8, seq_len=16, rows=slice(2, 4)
    )
    np.testing.assert_array_equal(val_part, val[:, 2:4])


def test_one_process_holds_every_row_of_the_batch():
    mesh = mesh_lib.build_mesh({"dp": 2, "fsdp": 4}, batch_size=16, hidden=128)
    assert mesh_lib.process_rows(mesh_lib.batch_sharding(mesh), 16) == slice(0, 16)


# The tiny preset, small: the two processes compile and run 4 steps in ~20 s on 2 cores.
RUN = ["--batch-size", "8", "--seq-len", "32", "--log-every", "1", "--eval-every", "2"]
RUN += ["--eval-batches", "1", "--checkpoint-every", "2", "--mesh", "dp=2,fsdp=4"]
STEPS, RESUMED_STEPS = 4, 6
TIMEOUT_S = 300  # bounds a hung run only
# Gloo's connection log, piece by piece: its threads write the pieces of their lines
# (text, a number, a newline) to one stream, which on a loaded machine interleave.
_GLOO_LOG = re.compile(r"\[Gloo\] Rank|is connected to|peer ranks\. Expected number of "
                       r"connected peer ranks is :|\d+")  # fmt: skip


def _options(out, steps, **kw) -> TrainOptions:
    return TrainOptions(
        out=str(out), batch_size=8, seq_len=32, log_every=1, eval_every=2, eval_batches=1,
        checkpoint_every=2, mesh="dp=2,fsdp=4", steps=steps, **kw,
    )  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(
    out: pathlib.Path, extra=lambda i: [], check: bool = True
) -> list[tuple[str, str]]:
    """Runs the command as processes 0 and 1 (``extra(i)``: more options); their (out, err)."""
    env = os.environ | {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": cpu_compile.with_devices(4),
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONUNBUFFERED": "1",
    }
    address = f"127.0.0.1:{_free_port()}"
    command = [sys.executable, "-m", "fp8jax_command", "train", *RUN, "--steps", str(STEPS)]
    command += ["--out", str(out), "--no-progress", "--coordinator-address", address]
    command += ["--num-processes", "2"]
    procs = [
        subprocess.Popen(
            [*command, "--process-id", str(i), *extra(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        outputs.append(("", f"timed out after {TIMEOUT_S} s"))
    finally:
        for proc in procs:  # only the processes this test started
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    if not check:
        return [(*o, p.returncode) for o, p in zip(outputs, procs, strict=True)]
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    assert not failed, f"processes {failed} failed:\n" + "\n---\n".join(
        "".join(o)[-3000:] for o in outputs
    )
    return outputs


def _final_params(run: pathlib.Path, step: int) -> dict:
    """The parameters of checkpoint ``step``, read onto one device of this process.

    Without a template orbax would lay arrays out on the devices that saved
    them, which a two-process checkpoint names and this process lacks.
    """
    path = (run / "checkpoints" / str(step) / "default").absolute()
    checkpointer = ocp.StandardCheckpointer()
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one_device),
        checkpointer.metadata(path).item_metadata.tree,
    )
    restored = checkpointer.restore(path, like)
    leaves = jax.tree_util.tree_leaves_with_path(restored["params"])
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


def _losses(run: pathlib.Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl")]


def _assert_same_run(got: pathlib.Path, want: pathlib.Path, step: int) -> None:
    # Same mesh and batches; only the all-reduces' summation order may differ
    # (Gloo between processes against XLA's in-process ones): f32 rounding.
    np.testing.assert_allclose(_losses(got)[:step], _losses(want)[:step], rtol=1e-5)
    a, b = _final_params(got, step), _final_params(want, step)
    assert a.keys() == b.keys() and a
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_two_processes_train_like_one_and_resume_in_one(tmp_path, shared_compile_cache):
    assert jax.device_count() == 8
    two, one = tmp_path / "two", tmp_path / "one"
    outputs = _run_two_processes(two)
    # Only process 0 prints the run; Gloo's C++ code logs its connections itself.
    assert "val" in outputs[0][0], outputs[0]
    assert _GLOO_LOG.sub("", outputs[1][0]).strip() == "", outputs[1]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == STEPS
    assert [r["step"] for r in read_metrics(two / "metrics.jsonl")] == list(range(1, STEPS + 1))

    quiet = {"progress": False, "say": lambda _: None}
    train(_options(one, STEPS), **quiet)
    _assert_same_run(two, one, STEPS)
    # Both resumed by this one process (8 devices, a different process count): orbax
    # lays the two-process checkpoint out anew. (--steps sets the learning-rate
    # schedule, so both runs continue to the same new length.)
    train(_options(two, RESUMED_STEPS, resume=True), **quiet)
    train(_options(one, RESUMED_STEPS, resume=True), **quiet)  # the compile cache's program
    _assert_same_run(two, one, RESUMED_STEPS)


def test_processes_that_read_different_text_are_refused_before_training(tmp_path):
    texts = []
    for i in range(2):
        texts.append(tmp_path / f"corpus-{i}.txt")
        texts[i].write_text(f"text of process {i}\n" * 400)
    results = _run_two_processes(
        tmp_path / "run", extra=lambda i: ["--data", str(texts[i])], check=False
    )
    for out, err, code in results:
        assert code == 2, (out, err)
        assert "processes [1] read a different corpus from process 0's" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

"""``fp8jax train``: the training loop, with its stops (divergence, Ctrl-C) and its summary.

Losses stay on the device between metrics lines; they are fetched (and
checked for NaN/Inf) at every log step and before every checkpoint, so the
host never waits for the device in between and a checkpoint never holds a
diverged state.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from fp8jax import compile_cache, data
from fp8jax.kernels import attention as attention_kernel
from fp8jax.ops import fine_grained
from fp8jax.training import distributed, gemm_count, mfu, summary
from fp8jax.training import mesh as mesh_lib
from fp8jax.training.config import OLD_RUN_DEFAULTS, RunConfig, TrainOptions, resolve
from fp8jax.training.errors import ConfigError, DivergedError, OutOfMemoryError, RunDirError
from fp8jax.training.profile import StepProfiler
from fp8jax.training.program import TrainProgram
from fp8jax.training.progress import Window, postfix, progress_bar, stop_on_ctrl_c
from fp8jax.training.run_dir import RunDir

VERIFY_TARGETS = ("h100", "h200", "live")
ATTENTION = ("auto", "xla", "cudnn", "fp8", "fp8-hadamard")


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """How a run ended: ``status`` is ``"completed"`` or ``"interrupted"``."""

    status: str
    step: int
    out: pathlib.Path
    summary: dict


def _check_options(options: TrainOptions) -> None:
    # An empty path is the working directory to pathlib: --out "$UNSET" wrote the run's
    # files there, and --data "$UNSET" trained on whatever files it held.
    if options.out == "":
        raise ConfigError("--out must be a directory path, got ''.")
    if options.data == "":
        raise ConfigError(
            "--data must be a text file or folder, got ''; leave --data out to train on the "
            "Python standard library's source."
        )
    if options.verify_target not in (None, *VERIFY_TARGETS):
        raise ConfigError(
            f"--verify-target must be one of {VERIFY_TARGETS}, got {options.verify_target!r}."
        )
    if options.attention not in ATTENTION:
        raise ConfigError(f"--attention must be one of {ATTENTION}, got {options.attention!r}.")
    if options.attention == "cudnn" and jax.default_backend() != "gpu":
        raise ConfigError(
            "--attention cudnn runs cuDNN's attention kernel, which needs an NVIDIA GPU; JAX's "
            f"backend here is {jax.default_backend()!r}. Use --attention xla, or auto (cuDNN on "
            "a GPU, XLA elsewhere)."
        )
    nan_at = options.inject_nan_at
    if nan_at is not None and (
        isinstance(nan_at, bool) or not isinstance(nan_at, int) or nan_at < 1
    ):
        raise ConfigError(f"--inject-nan-at must be an int >= 1, got {nan_at!r}.")
    # A switch is read for its truth value: resume="no" resumed.
    for switch in ("rolled_layers", "resume"):
        if not isinstance(getattr(options, switch), bool):
            raise ConfigError(f"{switch} must be a bool, got {getattr(options, switch)!r}.")
    if not isinstance(options.compile_cache, str):
        raise ConfigError(
            f"--compile-cache must be 'auto', 'none' or a directory, got {options.compile_cache!r}."
        )
    if options.profile is not None and (
        not isinstance(options.profile, str) or not options.profile
    ):
        raise ConfigError(f"--profile must be a directory path, got {options.profile!r}.")
    if options.profile is not None:
        _check_profile_dir(options.profile)
    keep = options.keep_checkpoints
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"--keep-checkpoints must be an int >= 1, got {keep!r}.")


def _check_profile_dir(directory: str) -> None:
    """Refuses a --profile that cannot become a directory.

    jax.profiler writes the trace only when it stops, after the traced steps, and a file
    in the directory's place failed there as a traceback, the run directory long written.
    """
    path = pathlib.Path(directory).expanduser()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = (
            "is a file" if existing == path else f"cannot be created: {str(existing)!r} is a file"
        )
        raise ConfigError(
            f"--profile {directory!r} {what}, not a directory; pass a directory path."
        )


def train(
    options: TrainOptions,
    *,
    progress: bool | None = None,
    on_step: Callable[[int], None] | None = None,
    say: Callable[[str], None] | None = None,
) -> TrainResult:
    """Trains the GPT of ``options`` and writes its run directory.

    Args:
      options: the run; see :class:`~fp8jax.training.TrainOptions`.
      progress: show the tqdm bar (None: only on a terminal).
      on_step: called with each step number once the step is dispatched
        (tests raise KeyboardInterrupt from it).
      say: where messages go (default ``tqdm.write``, which keeps the bar intact).

    Returns:
      A :class:`TrainResult`. Ctrl-C (or a KeyboardInterrupt) saves a
      checkpoint and returns with status ``"interrupted"``.

    Raises:
      ConfigError, fp8jax.data.DataError, RunDirError, CheckpointError: before
        anything is written, for bad options, data or run directories.
      DivergedError: the loss became NaN/Inf; the last good checkpoint is kept.
      OutOfMemoryError: XLA ran out of device memory; the message names the
        options that shrink the step, and ``summary.json`` records it.
    """
    # Several processes meet before anything starts JAX's backends (_check_options does).
    launch = distributed.plan(options.coordinator_address, options.num_processes,
                              options.process_id)  # fmt: skip
    distributed.initialize(launch)
    # Every check comes before the first file is written (the run directory, the cache).
    _check_options(options)
    config = resolve(options)
    _check_attention(config, options.attention)
    run = RunDir(options.out, writer=distributed.is_writer())
    run.check_usable()
    cache_dir = _compile_cache_dir(options.compile_cache)
    axes = mesh_lib.parse_mesh(options.mesh)
    mesh = mesh_lib.build_mesh(
        axes, batch_size=config.batch_size, hidden=config.model.hidden, experts=config.model.experts
    )
    distributed.check_mesh(mesh)
    _check_recipe_devices(config, mesh)
    try:
        corpus = data.load_corpus(options.data)
    except OSError as e:  # unreadable files, a folder in a file's place: not a DataError
        raise ConfigError(
            f"--data {options.data!r} cannot be read: {e}; pass readable text files."
        ) from None
    data.check_size(corpus, config.seq_len)
    differ = distributed.differing_processes(corpus.fingerprint)
    if differ:  # each process would train on other batches, silently
        raise data.DataError(
            f"--data: processes {differ} read a different corpus from process 0's "
            f"({corpus.source}, SHA-256 fingerprints differ); every process must read the same "
            "text. Put it on a shared file system or at the same path on every host and pass "
            "--data (the default, each host's Python standard library, differs between Python "
            "builds)."
        )
    if cache_dir is not None:  # created first: a run directory left without a run is worse
        try:
            compile_cache.enable(cache_dir)
        except ValueError as e:
            raise ConfigError(f"--compile-cache: {e}") from None
    fingerprint = {"data": {"source": corpus.source, "fingerprint": corpus.fingerprint}}
    record = config.to_dict() | fingerprint
    start = 0
    if options.resume:
        start = run.check_resume(record, RunConfig.MAY_CHANGE, OLD_RUN_DEFAULTS)
        if start >= config.steps:
            raise RunDirError(
                f"--resume: the run in {run.path} is already at step {start}; pass --steps "
                f"larger than {start} to train it further."
            )
    else:
        run.start(record)
    say = say or tqdm.write
    if not distributed.is_writer():  # process 0 speaks for the run
        say, progress = (lambda _: None), False
    if cache_dir is not None:
        say(f"compile cache: {cache_dir}")
    # Optax's AdamW mixes its int32 step count with f32: standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        try:
            program = TrainProgram(
                config, mesh, options.attention, unroll_layers=not options.rolled_layers
            )
        except jax.errors.JaxRuntimeError as e:
            raise out_of_memory(e, config, mesh, "initializing the parameters") or e from None
        state = program.initial_state
        if options.resume:
            state = run.restore(start, state)
            # Only now, with the checkpoint accepted, is anything in the run rewritten.
            run.resumed(record, start)
            if run.saved_config.get("steps") != config.steps:
                say(
                    f"note: --steps changed from {run.saved_config.get('steps')} to "
                    f"{config.steps}; the learning-rate schedule now decays over the new length."
                )
        loop = _Loop(program, run, corpus, options, say)
        with program.sharding_context():
            return loop.run(state, start, progress, on_step)


def _check_attention(config: RunConfig, attention: str) -> None:
    """Refuses ``--attention fp8`` for shapes its kernels do not tile, before anything is written.

    fp8jax.dot_product_attention would refuse them too, but only when the first
    step traces, after the run directory exists, as a traceback that names
    neither the option nor the preset.
    """
    if attention not in ("fp8", "fp8-hadamard"):
        return
    head_dim = config.model.hidden // config.model.heads
    if head_dim not in attention_kernel.HEAD_DIMS:
        raise ConfigError(
            f"--attention {attention} needs a head_dim in {attention_kernel.HEAD_DIMS} (the FP8 "
            f"kernels' tiles); the preset {config.name!r} has {head_dim}. Use --attention xla or "
            "auto, or a preset such as small."
        )
    if config.seq_len % attention_kernel.BLOCK:
        raise ConfigError(
            f"--attention {attention} needs a --seq-len that is a multiple of "
            f"{attention_kernel.BLOCK} (one FP8 scale per {attention_kernel.BLOCK} rows), got "
            f"{config.seq_len}."
        )


def _check_recipe_devices(config: RunConfig, mesh) -> None:
    """Refuses ``--recipe mxfp8`` on GPUs older than Blackwell before anything is written.

    The ops would refuse too, but only once the first step traces, from deep
    inside it; here the message names the option.
    """
    if config.precision != "fp8" or config.recipe != "mxfp8":
        return
    devices = jax.local_devices() if mesh is None else list(mesh.devices.flat)
    try:
        fine_grained.check_devices(devices, advice="Use --recipe block on Hopper.")
    except ValueError as e:
        raise ConfigError(f"--recipe mxfp8: {e}") from None


def _compile_cache_dir(setting: str) -> str | None:
    """The cache directory ``setting`` asks for (checked, not yet created), or None."""
    try:
        directory = compile_cache.resolve(setting)
        return None if directory is None else compile_cache.check(directory)
    except ValueError as e:
        raise ConfigError(f"--compile-cache: {e}") from None


class _Loop:
    """One session of training steps, from ``start`` to ``config.steps``."""

    def __init__(self, program: TrainProgram, run: RunDir, corpus, options: TrainOptions, say):
        self.program, self.run_dir, self.corpus, self.options = program, run, corpus, options
        self.config, self.say = program.config, say
        c = self.config
        self.window = Window(c.batch_size * c.seq_len)
        self.val = data.validation_batches(
            corpus.validation, batches=c.eval_batches, batch_size=c.batch_size,
            seq_len=c.seq_len, rows=program.rows,
        )  # fmt: skip
        self.pending: list[tuple[int, jax.Array]] = []
        self.last_train = self.last_val = self.compile_s = None
        self.load_balance = self.dropped = None
        self.counts: dict = {}
        self.diverged_at: int | None = None
        self.flops_per_token = mfu.flops_per_token(c.model, c.seq_len)
        devices = None if program.mesh is None else list(program.mesh.devices.flat)
        self.peak, self.device_kind = mfu.peak_flops(devices or jax.devices()[:1])
        self.devices = 1 if devices is None else len(devices)

    def batch(self, step: int):
        """The batch that step ``step`` (1-based) trains on."""
        c = self.config
        tokens = data.train_batch(
            self.corpus.train, step - 1, batch_size=c.batch_size, seq_len=c.seq_len, seed=c.seed,
            rows=self.program.rows,
        )  # fmt: skip
        return self.program.put(tokens)

    def check_pending(self) -> None:
        """Fetches the losses since the last check; raises DivergedError on NaN/Inf."""
        values = jax.device_get([loss for _, loss in self.pending])
        for (step, _), value in zip(self.pending, values, strict=True):
            if not math.isfinite(float(value)):
                raise self.diverged(f"the loss is {float(value)}", step)
        timed = [step for step, _ in self.pending if step > self.start + 1]
        self.window.add([float(v) for v in values], len(timed))
        self.window.timed(timed)
        self.pending.clear()

    def diverged(self, what: str, step: int) -> DivergedError:
        self.diverged_at = step
        message = summary.diverged_message(
            what, step, self.last_saved, self.run_dir.path, self.config.checkpoint_every
        )
        return DivergedError(message)

    def save(self, state, step: int) -> None:
        """Checkpoints ``state`` at ``step``, unless it is saved already or not finite."""
        if self.last_saved == step:
            return
        if not bool(self.program.all_finite(state.params)):
            raise self.diverged("the parameters are not finite", step)
        with self.window.excluding():
            self.run_dir.save(step, state, keep=self.options.keep_checkpoints)
        self.last_saved = step

    def log(self, state, step: int, bar) -> None:
        c = self.config
        metrics = {"step": step, **self.window.close()}
        if "tokens_per_s" in metrics and self.peak is not None:
            metrics["mfu"] = mfu.mfu(metrics["tokens_per_s"], self.flops_per_token, self.peak)
        self.last_train = metrics["loss"]
        if self.program.moe:  # a forward on this step's batch, outside the timed window
            with self.window.excluding():
                balance, dropped = self.program.routing(state, self.batch(step))
            metrics["load_balance"] = self.load_balance = float(balance)
            if c.model.capacity_factor is not None:
                metrics["dropped"] = self.dropped = float(dropped)
        if step % c.eval_every == 0 or step == c.steps:
            with self.window.excluding():
                losses = [float(self.program.eval(state, self.program.put(b))) for b in self.val]
            metrics["val_loss"] = self.last_val = float(np.mean(losses))
        # Outside the timing: the schedule runs as eager JAX ops, compiled on the
        # first call (about 1 s on a GPU), which fell into the second window.
        with self.window.excluding():
            metrics["lr"] = float(c.schedule()(step - 1))
        self.run_dir.append_metrics(metrics)
        bar.set_postfix(postfix(metrics), refresh=False)
        if bar.disable or "val_loss" in metrics:
            self.say(summary.metrics_line(metrics))

    def run(self, state, start: int, progress, on_step) -> TrainResult:
        c, program = self.config, self.program
        self.start, self.last_saved = start, (start or None)
        self.counts["jaxpr"] = gemm_count.jaxpr_counts(program.raw_step, state, self.batch(1))
        bar = progress_bar(
            total=c.steps, initial=start, desc=f"{c.name} {c.precision}", enabled=progress
        )
        status, step = "completed", start
        profiler = StepProfiler(self.options.profile, start, c.steps, self.say)

        def kept() -> str:  # read by the Ctrl-C thread when it ends the process
            if self.last_saved is None:
                return "no checkpoint was saved."
            return f"checkpoint {self.last_saved} in {self.run_dir.checkpoints} is kept."

        def abort() -> str:
            return f"aborted by a second Ctrl-C; {kept()}"

        def finish() -> str:
            return f"interrupted while finishing the run; {kept()}"

        try:
            try:
                # From the header on, Ctrl-C stops the run after the step it interrupts, or
                # after the first step if it comes earlier, and saves a checkpoint there.
                with stop_on_ctrl_c(self.say, abort, finish) as stop_requested:
                    self.say(
                        summary.header(
                            c,
                            self.corpus,
                            program.mesh,
                            self.counts["jaxpr"],
                            program.attention,
                            program.layers,
                        )
                    )
                    if self.options.verify_target:
                        self.counts["deviceless"] = gemm_count.deviceless_counts(
                            program.raw_step, state, self.batch(1),
                            target=self.options.verify_target, mesh=program.mesh,
                        )  # fmt: skip
                        self.say("  " + summary.deviceless_text(self.counts["deviceless"]))
                    self.say("  " + mfu.describe(self.peak, self.device_kind, self.devices))
                    t0 = time.perf_counter()
                    for step in range(start + 1, c.steps + 1):
                        profiler.before(step)
                        batch = self.batch(step)
                        if self.options.inject_nan_at == step:  # testing aid, see TrainOptions
                            state = state._replace(params=_poisoned(state.params))
                        state, loss = program.step(state, batch)
                        self.pending.append((step, loss))
                        if step == start + 1:  # the first step's time is mostly compile
                            loss.block_until_ready()
                            self.compile_s = time.perf_counter() - t0
                            self.window.start_timing()
                        profiler.after(step, loss)
                        bar.update(1)
                        if on_step is not None:
                            on_step(step)
                        last = step == c.steps
                        if step % c.log_every == 0 or step % c.checkpoint_every == 0 or last:
                            self.check_pending()
                        if step % c.log_every == 0 or last:
                            self.log(state, step, bar)
                        if step % c.checkpoint_every == 0 or last:
                            self.save(state, step)
                        if stop_requested():
                            raise KeyboardInterrupt
            except KeyboardInterrupt:
                profiler.stop()
                status, step = "interrupted", self.interrupted(state)
        except DivergedError as e:
            profiler.stop()
            bar.close()
            record = {"error": str(e), "diverged_at": self.diverged_at}
            self.run_dir.write_summary(self.summary("diverged", step) | record)
            raise
        except jax.errors.JaxRuntimeError as e:
            error = out_of_memory(e, c, program.mesh, f"running step {step}")
            if error is None:
                raise
            profiler.stop()
            bar.close()
            self.run_dir.write_summary(self.summary("out_of_memory", step) | {"error": str(error)})
            raise error from None
        bar.close()
        result = self.summary(status, step)
        self.run_dir.write_summary(result)
        self.say(summary.text(result, self.run_dir.path))
        return TrainResult(status=status, step=step, out=self.run_dir.path, summary=result)

    def interrupted(self, state) -> int:
        """Saves ``state`` after Ctrl-C; returns the step it holds."""
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(state)):
            # Interrupted between donating the old state and receiving the new one.
            self.say(f"Interrupted inside a step; checkpoint {self.last_saved} is kept.")
            return self.last_saved or 0
        self.check_pending()
        step = int(state.step)
        if step:
            self.save(state, step)
        return step

    def summary(self, status: str, step: int) -> dict:
        return summary.build(
            self.config,
            status=status,
            step=step,
            train_loss=self.last_train,
            val_loss=self.last_val,
            tokens_per_s=self.window.tokens_per_s(),
            timed_steps=self.window.timed_range,
            compile_s=self.compile_s,
            train_s=self.window.train_seconds,
            counts=self.counts,
            checkpoint=self.last_saved,
            mesh=self.program.mesh,
            attention=self.program.attention,
            layers=self.program.layers,
            flops_per_token=self.flops_per_token,
            peak_flops=self.peak,
            device_kind=self.device_kind,
            devices=self.devices,
            load_balance=self.load_balance,
            dropped=self.dropped,
        )


def out_of_memory(
    error: Exception, config: RunConfig, mesh, during: str
) -> OutOfMemoryError | None:
    """An :class:`OutOfMemoryError` that names the options to change, if ``error`` is
    XLA's out-of-memory error (``RESOURCE_EXHAUSTED``); otherwise None.

    XLA's own message is a traceback from inside the step that names a buffer
    size but neither the option that sized it nor what to do.
    """
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    first = text.strip().splitlines()[0] if text.strip() else text
    if len(first) > 300:
        first = first[:300] + "..."
    where = "" if mesh is None else f" on the mesh {dict(mesh.shape)}"
    advice = [
        f"a smaller --batch-size (the run has {config.batch_size}) or --seq-len "
        f"(it has {config.seq_len})",
        "--accumulation-steps N (the same batch as N micro-batches)"
        if config.accumulation_steps == 1
        else f"more --accumulation-steps (the run has {config.accumulation_steps})",
    ]
    if config.remat != "full":
        advice.append(f"--remat dots or full (recompute activations; the run has {config.remat})")
    if mesh is None or mesh.shape.get("fsdp", 1) == 1:
        advice.append("a mesh with fsdp over several devices (shards parameters and AdamW state)")
    return OutOfMemoryError(
        f"out of device memory while {during} of {config.name} ({config.precision}){where}; "
        f"XLA said: {first} Try " + ", or ".join(advice) + "."
    )


def _poisoned(params):
    # --inject-nan-at: NaN parameters make this step's loss NaN, through the real train step.
    return jax.tree.map(lambda p: p * jnp.asarray(jnp.nan, p.dtype), params)

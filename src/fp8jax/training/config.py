"""What a training run is: the named presets, the options, the optimizer and the recipe."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np
import optax

import fp8jax
from fp8jax import optim
from fp8jax.models.gpt import PRECISIONS, REMAT_POLICIES, GptConfig
from fp8jax.training.errors import ConfigError

# --recipe names and the recipe each builds (RunConfig.fp8_recipe); a new
# recipe is one more entry here.
RECIPES = ("current", "delayed", "row", "block", "mxfp8")
REMAT = tuple(REMAT_POLICIES)
DELAYED_HISTORY = 16  # amax history of --recipe delayed; short, so the scales follow training


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset:
    """A named configuration: the model and its training hyperparameters.

    Attributes:
      model: the GPT's shape.
      seq_len: bytes per sequence.
      batch_size: sequences per step (global, over every device).
      learning_rate: peak AdamW learning rate (linear warmup, cosine to 10%).
      warmup_steps: linear warmup length (capped at a tenth of the run).
      steps: default number of steps.
      log_every: steps per metrics line.
      eval_every: steps per validation loss (a multiple of log_every).
      eval_batches: validation batches per evaluation.
      checkpoint_every: steps per checkpoint.
      remat: activation checkpointing (a key of ``fp8jax.models.gpt.REMAT_POLICIES``).
    """

    model: GptConfig
    seq_len: int
    batch_size: int
    learning_rate: float
    warmup_steps: int
    steps: int
    log_every: int
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    remat: str = "none"


# Sequences per step of the Llama presets (docs/train.md#llama-presets).
LLAMA_1B_BATCH = 16
LLAMA_3B_BATCH = 8
# Depth and sequences per step of the H200 MoE presets, whose layers are bench/moe.py's
# SHAPES (Mixtral-8x7B's, DeepSeek-V2-Lite's): there FP8's grouped GEMMs pay, where at
# hidden 1024 the step gained 1.21x. At these widths the f32 parameters and AdamW's two
# moments (12 bytes a parameter) fill most of the H200, so the depth is what leaves
# room for a batch: at each depth, the largest even batch whose BF16 step, compiled
# deviceless for an H200, peaks under 100 GiB, 95% of JAX's default share
# (bench/moe_memory.py, docs/train.md#moe-presets,
# docs/design.md#the-moe-presets-shapes-and-batches).
# mixtral: 4 layers x 4 sequences, bench/moe.py's 16384 tokens, 94.3 GiB (6: 103.5;
# 5 layers x 2: 105.6); deepseek: 8 layers x 8, 94.8 GiB (10: 104.6), where 10 layers
# x 4 (95.3) would halve its 64 experts' rows, 3072 each. The FP8 steps peak lower.
MIXTRAL_LAYERS = 4
MIXTRAL_BATCH = 4
DEEPSEEK_LAYERS = 8
DEEPSEEK_BATCH = 8

PRESETS = {
    # About 0.15 s a step on 2 CPU cores: 300 steps take under a minute.
    "tiny": Preset(
        model=GptConfig(hidden=128, layers=2, heads=4, ffn=384),
        seq_len=128, batch_size=16, learning_rate=3e-3, warmup_steps=30, steps=300,
        log_every=10, eval_every=50, eval_batches=16, checkpoint_every=100,
    ),
    # GPU presets: head_dim 64, every GEMM dimension a multiple of 128.
    # small sees 8.2 M bytes in its 2000 steps, under one pass over a 10 MB
    # stdlib (Ubuntu's python3.12): the first version (85 M params, 32 k bytes
    # a step) made 6 passes, and its validation loss rose after step 1000.
    "small": Preset(
        model=GptConfig(hidden=512, layers=8, heads=8, ffn=1536),
        seq_len=512, batch_size=8, learning_rate=1e-3, warmup_steps=200, steps=2000,
        log_every=20, eval_every=200, eval_batches=32, checkpoint_every=500,
    ),
    "medium": Preset(
        model=GptConfig(hidden=1024, layers=24, heads=16, ffn=2816),
        seq_len=1024, batch_size=32, learning_rate=6e-4, warmup_steps=200, steps=4000,
        log_every=20, eval_every=200, eval_batches=16, checkpoint_every=500,
    ),
    # Llama-3.2-shaped (RMSNorm, SwiGLU, RoPE, GQA, no biases) over bytes. The
    # batch sizes fill one H200 (141 GB) in BF16 without activation
    # checkpointing, measured by the compiled step's peak
    # (docs/train.md#llama-presets).
    "llama-1b": Preset(
        model=GptConfig(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
        seq_len=4096, batch_size=LLAMA_1B_BATCH, learning_rate=3e-4, warmup_steps=200,
        steps=2000, log_every=10, eval_every=200, eval_batches=8, checkpoint_every=500,
    ),
    "llama-3b": Preset(
        model=GptConfig(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
        seq_len=4096, batch_size=LLAMA_3B_BATCH, learning_rate=3e-4, warmup_steps=200,
        steps=2000, log_every=10, eval_every=200, eval_batches=8, checkpoint_every=500,
    ),
    # Mixture-of-Experts presets (docs/train.md#moe-presets): Mixtral-shaped (8
    # SwiGLU experts, top-2) and DeepSeek-shaped (fine-grained: 64 routed experts,
    # top-6, 2 shared, the first layer dense). The -tiny ones run on a CPU in
    # seconds; the others are sized for one H200 in BF16 (MIXTRAL_LAYERS above).
    "mixtral-tiny": Preset(
        model=GptConfig(hidden=64, layers=2, heads=4, ffn=128, experts=8, top_k=2),
        seq_len=64, batch_size=8, learning_rate=3e-3, warmup_steps=10, steps=40,
        log_every=10, eval_every=20, eval_batches=2, checkpoint_every=20,
    ),
    "deepseek-tiny": Preset(
        model=GptConfig(hidden=64, layers=2, heads=4, ffn=128, experts=64, top_k=6,
                        expert_ffn=32, shared_experts=2, dense_layers=1),
        seq_len=64, batch_size=8, learning_rate=3e-3, warmup_steps=10, steps=40,
        log_every=10, eval_every=20, eval_batches=2, checkpoint_every=20,
    ),
    # small's shape and schedule with MoE feed-forwards, for the three-seed convergence
    # protocol (docs/train.md#moe-presets, bench/moe_convergence.py): minutes on an H200.
    # Every expert GEMM width a multiple of 128, as the BF16 grouped kernels need.
    "mixtral-small": Preset(
        model=GptConfig(hidden=512, layers=8, heads=8, ffn=1536, experts=8, top_k=2),
        seq_len=512, batch_size=8, learning_rate=1e-3, warmup_steps=200, steps=2000,
        log_every=20, eval_every=200, eval_batches=32, checkpoint_every=500,
    ),
    "deepseek-small": Preset(
        model=GptConfig(hidden=512, layers=8, heads=8, ffn=1536, experts=64, top_k=6,
                        expert_ffn=256, shared_experts=2, dense_layers=1),
        seq_len=512, batch_size=8, learning_rate=1e-3, warmup_steps=200, steps=2000,
        log_every=20, eval_every=200, eval_batches=32, checkpoint_every=500,
    ),
    # Mixtral-8x7B's layer (head_dim 128, 8 kv heads) and DeepSeek-V2-Lite's. V2-Lite's
    # latent attention trains as 16 full heads of keys and values, so deepseek's attention
    # is multi-head. Its dense first layer is 11008 wide (Llama-2-7B's): V2-Lite's 10944
    # is no multiple of 128, which every GEMM width here is (the BF16 grouped kernels'
    # tiles).
    "mixtral": Preset(
        model=GptConfig(hidden=4096, layers=MIXTRAL_LAYERS, heads=32, kv_heads=8, ffn=14336,
                        experts=8, top_k=2),
        seq_len=4096, batch_size=MIXTRAL_BATCH, learning_rate=3e-4, warmup_steps=200,
        steps=2000, log_every=10, eval_every=200, eval_batches=8, checkpoint_every=500,
    ),
    "deepseek": Preset(
        model=GptConfig(hidden=2048, layers=DEEPSEEK_LAYERS, heads=16, ffn=11008, experts=64,
                        top_k=6, expert_ffn=1408, shared_experts=2, dense_layers=1),
        seq_len=4096, batch_size=DEEPSEEK_BATCH, learning_rate=3e-4, warmup_steps=200,
        steps=2000, log_every=10, eval_every=200, eval_batches=8, checkpoint_every=500,
    ),
}  # fmt: skip
MOE_AUX_WEIGHT = 0.01  # Switch Transformer's coefficient for the load-balancing loss
MOE_FIELDS = ("experts", "top_k", "expert_ffn", "shared_experts", "dense_layers", "capacity_factor")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """Everything ``fp8jax train`` takes. ``None`` means the preset's value.

    Attributes:
      out: the run directory (config.json, metrics.jsonl, checkpoints/, summary.json).
      config: a preset name from :data:`PRESETS`.
      precision: ``"fp8"`` or ``"bf16"``.
      recipe: ``"current"``, ``"delayed"``, ``"row"`` (RowwiseScaling), ``"block"``
        (BlockScaling) or ``"mxfp8"`` (MXFP8Scaling: Blackwell GPUs, or the CPU's
        reference path); FP8 only, default current.
      steps, batch_size, seq_len, learning_rate, log_every, eval_every,
      eval_batches, checkpoint_every: override the preset.
      seed: initialization and batch order.
      data: a text file or folder; None is the Python standard library's source.
      mesh: ``"dp=2,fsdp=4"``-style device mesh; None is one device.
      resume: continue the run in ``out`` from its newest checkpoint.
      keep_checkpoints: checkpoints kept on disk (the newest ones).
      attention: the attention core: ``"xla"``, ``"cudnn"``, ``"fp8"``
        (:func:`fp8jax.dot_product_attention`, opt-in), ``"fp8-hadamard"`` (the
        same with ``hadamard=True``: Q and K rotated before quantizing), or
        ``"auto"`` (cuDNN on a GPU, XLA elsewhere).
      rolled_layers: keep the scan over layers a loop instead of unrolling it
        (``Gpt.unroll_layers=False``): faster to compile, and under FSDP it
        holds one layer's gathered kernels at a time, but the step is slower
        (the loop copies each layer's saved activations; docs/design.md#the-gpt-model).
      remat: activation checkpointing of each block: ``"none"``, ``"dots"``
        (keep the GEMM outputs and FP8 casts) or ``"full"`` (keep each block's
        input); None is the preset's (docs/design.md#activation-checkpointing).
      accumulation_steps: split each step's batch into this many
        micro-batches, average their gradients and merge their delayed-scaling
        states by max (``fp8jax.combine_states``); must divide the batch size.
      profile: write a ``jax.profiler`` trace of a few steps after the first
        (compile) step into this directory (TensorBoard/Perfetto).
      compile_cache: JAX's persistent compilation cache: ``"auto"`` (the
        default: ``fp8jax.compile_cache.default_dir()`` on a GPU, none
        elsewhere), ``"none"``, or a directory. The first FP8 compile on an
        H200 spends minutes autotuning GEMMs; with the cache, later runs of
        the same shapes skip it (:mod:`fp8jax.compile_cache`).
      verify_target: also compile the train step for a GPU and count its FP8
        GEMMs: ``"h100"`` or ``"h200"`` deviceless (needs ``fp8jax[verify]``),
        or ``"live"`` on this machine's GPU.
      inject_nan_at: testing only: poison the parameters before this step so
        its loss is NaN, to exercise the divergence stop.
      moe_aux_weight: MoE presets: the load-balancing loss's weight in the
        training loss (default :data:`MOE_AUX_WEIGHT`).
      coordinator_address, num_processes, process_id: join a multi-process
        run (``jax.distributed.initialize``); left out, SLURM and Open MPI
        launches are detected and one process runs alone otherwise
        (:mod:`fp8jax.training.distributed`).
    """

    out: str
    config: str = "tiny"
    precision: str = "fp8"
    recipe: str | None = None
    steps: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    learning_rate: float | None = None
    log_every: int | None = None
    eval_every: int | None = None
    eval_batches: int | None = None
    checkpoint_every: int | None = None
    seed: int = 0
    data: str | None = None
    mesh: str | None = None
    resume: bool = False
    keep_checkpoints: int = 3
    attention: str = "auto"
    rolled_layers: bool = False
    remat: str | None = None
    accumulation_steps: int | None = None
    profile: str | None = None
    compile_cache: str = "auto"
    verify_target: str | None = None
    inject_nan_at: int | None = None
    moe_aux_weight: float | None = None
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The resolved run: a preset with the options applied, checked."""

    name: str
    model: GptConfig
    precision: str
    recipe: str | None
    seq_len: int
    batch_size: int
    learning_rate: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    seed: int
    steps: int
    log_every: int
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    remat: str = "none"
    accumulation_steps: int = 1
    moe_aux_weight: float = MOE_AUX_WEIGHT

    # A resumed run must agree on everything else; these may change between sessions.
    # (The warmup is a tenth of the run at most, so it follows --steps.)
    # Activation checkpointing changes what is recomputed, not the result.
    MAY_CHANGE = (
        "remat",
        "steps",
        "warmup_steps",
        "log_every",
        "eval_every",
        "eval_batches",
        "checkpoint_every",
    )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model"] = dataclasses.asdict(self.model)
        if not self.model.experts:  # a dense model's config.json as before the MoE fields
            for field in MOE_FIELDS:
                del d["model"][field]
        return d

    def fp8_recipe(self):
        """The fp8jax recipe object, or None for BF16."""
        if self.precision == "bf16":
            return None
        if self.recipe == "delayed":
            return fp8jax.DelayedScaling(amax_history_len=DELAYED_HISTORY)
        fine = {
            "row": fp8jax.RowwiseScaling,
            "block": fp8jax.BlockScaling,
            "mxfp8": fp8jax.MXFP8Scaling,
        }.get(self.recipe)
        return fp8jax.CurrentScaling() if fine is None else fine()

    def schedule(self) -> optax.Schedule:
        """Linear warmup to the peak learning rate, then cosine decay to 10% at ``steps``."""
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=self.learning_rate,
            warmup_steps=self.warmup_steps,
            decay_steps=max(self.steps, self.warmup_steps + 1),
            end_value=self.learning_rate / 10,
        )

    def optimizer(self) -> optax.GradientTransformation:
        """AdamW (b2 0.95) on :meth:`schedule`, after global-norm gradient clipping.

        :func:`fp8jax.optim.fused_adamw`: optax's clip + AdamW chain bit for
        bit, with its state (checkpoints of either resume with the other), as
        one fused update per parameter.
        """
        return optim.fused_adamw(
            self.schedule(), b2=0.95, weight_decay=self.weight_decay,
            max_grad_norm=self.grad_clip,
        )  # fmt: skip


# What runs whose config.json predates these RunConfig fields did: they resume with these.
OLD_RUN_DEFAULTS = {"remat": "none", "accumulation_steps": 1, "moe_aux_weight": MOE_AUX_WEIGHT}

# The RunConfig fields a resumed run takes from config.json when the command line leaves
# them out (the name is the preset's; the model follows from it).
_SAVED_OPTIONS = (
    "precision",
    "recipe",
    "seq_len",
    "batch_size",
    "learning_rate",
    "seed",
    "steps",
    "log_every",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "remat",
    "accumulation_steps",
    "moe_aux_weight",
)


def saved_options(saved: dict[str, Any], default_data: str) -> dict[str, Any]:
    """The :class:`TrainOptions` fields that a run's ``config.json`` recorded.

    ``fp8jax train --out DIR --resume`` starts from these and applies only the
    options given on the command line, so a resume needs no options repeated.

    Args:
      saved: the parsed ``config.json``.
      default_data: the corpus source recorded when ``--data`` was left out
        (the standard library's path); such a run resumes with ``data=None``.
    """
    options = {k: saved[k] for k in _SAVED_OPTIONS if k in saved}
    if isinstance(saved.get("name"), str):
        options["config"] = saved["name"]
    source = saved.get("data", {}).get("source") if isinstance(saved.get("data"), dict) else None
    if isinstance(source, str) and source != default_data:
        options["data"] = source
    return options


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"--{name.replace('_', '-')} must be an int >= 1, got {value!r}.")
    return int(value)


def resolve(options: TrainOptions) -> RunConfig:
    """The :class:`RunConfig` of ``options``.

    Raises:
      ConfigError: for an unknown preset, precision, recipe or remat policy, or bad numbers.
    """
    if options.config not in PRESETS:
        raise ConfigError(f"--config must be one of {sorted(PRESETS)}, got {options.config!r}.")
    if options.precision not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {PRECISIONS}, got {options.precision!r}.")
    recipe = options.recipe
    if options.precision == "bf16":
        if recipe is not None:
            raise ConfigError(
                f"--recipe {recipe} applies to FP8 GEMMs; --precision bf16 runs none. "
                "Drop --recipe or use --precision fp8."
            )
    elif recipe is None:
        recipe = "current"
    elif recipe not in RECIPES:
        raise ConfigError(f"--recipe must be one of {RECIPES}, got {recipe!r}.")
    preset = PRESETS[options.config]
    remat = preset.remat if options.remat is None else options.remat
    if remat not in REMAT:
        raise ConfigError(f"--remat must be one of {REMAT}, got {remat!r}.")

    def pick(name):
        value = getattr(options, name)
        return _positive(name, getattr(preset, name) if value is None else value)

    steps, log_every, eval_every = pick("steps"), pick("log_every"), pick("eval_every")
    batch_size = pick("batch_size")
    accumulation = 1 if options.accumulation_steps is None else options.accumulation_steps
    accumulation = _positive("accumulation_steps", accumulation)
    if batch_size % accumulation:
        raise ConfigError(
            f"--accumulation-steps must divide --batch-size ({batch_size}) into equal "
            f"micro-batches, got {accumulation}."
        )
    if eval_every % log_every:
        raise ConfigError(
            f"--eval-every ({eval_every}) must be a multiple of --log-every ({log_every}): "
            "validation losses are written on metrics lines."
        )
    learning_rate = preset.learning_rate if options.learning_rate is None else options.learning_rate
    if not isinstance(learning_rate, numbers.Real) or not learning_rate > 0:
        raise ConfigError(f"--lr must be a number > 0, got {learning_rate!r}.")
    if not math.isfinite(learning_rate):
        raise ConfigError(f"--lr must be a finite number > 0, got {learning_rate!r}.")
    f32 = np.finfo(np.float32)
    if not float(f32.tiny) <= learning_rate <= float(f32.max):  # f64: no overflowing cast
        # The schedule computes in f32: a smaller peak became 0 (also subnormals, flushed),
        # a run that silently never moved; a larger one inf, NaN parameters after step 1.
        raise ConfigError(
            f"--lr must be within float32's normal range [{f32.tiny:.3g}, {f32.max:.3g}], "
            f"as the optimizer computes in f32; got {learning_rate!r}."
        )
    if preset.model.experts and recipe not in (None, "current"):
        raise ConfigError(
            f"--recipe {recipe}: the MoE preset {options.config!r} runs its experts on grouped "
            "GEMMs that take current scaling only (per-tensor and per-expert scales); use "
            "--recipe current, or --precision bf16."
        )
    aux_weight = MOE_AUX_WEIGHT if options.moe_aux_weight is None else options.moe_aux_weight
    if (isinstance(aux_weight, bool) or not isinstance(aux_weight, numbers.Real)
            or not 0 <= aux_weight < math.inf):  # fmt: skip
        raise ConfigError(f"--moe-aux-weight must be a finite number >= 0, got {aux_weight!r}.")
    # A dense run's config.json records the default, which its --resume passes back.
    if not preset.model.experts and aux_weight != MOE_AUX_WEIGHT:
        moe_presets = sorted(name for name, p in PRESETS.items() if p.model.experts)
        raise ConfigError(
            f"--moe-aux-weight weighs the MoE load-balancing loss; the dense preset "
            f"{options.config!r} has none, so it would be ignored, got {aux_weight!r}. Drop it "
            f"or use an MoE preset ({', '.join(moe_presets)})."
        )
    seed = options.seed
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**32:
        # jax.random.key and numpy's batch order both take an unsigned 32-bit seed.
        raise ConfigError(f"--seed must be an int in [0, 2**32), got {seed!r}.")
    return RunConfig(
        name=options.config,
        model=preset.model,
        precision=options.precision,
        recipe=recipe if options.precision == "fp8" else None,
        seq_len=pick("seq_len"),
        batch_size=batch_size,
        learning_rate=float(learning_rate),
        warmup_steps=min(preset.warmup_steps, max(steps // 10, 1)),
        weight_decay=0.1,
        grad_clip=1.0,
        seed=int(options.seed),
        steps=steps,
        log_every=log_every,
        eval_every=eval_every,
        eval_batches=pick("eval_batches"),
        checkpoint_every=pick("checkpoint_every"),
        remat=remat,
        accumulation_steps=accumulation,
        moe_aux_weight=float(aux_weight),
    )

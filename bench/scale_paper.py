"""The bytes an FP8 train step moves at 8, 64 and 512 H100s, on paper, from deviceless compiles.

For each model, GPU count and layout the FP8 (current scaling) and the BF16
train step of ``fp8jax train`` are compiled for H100s with no GPU present
(``fp8jax.verify.compile_many``), the layer scan kept a loop
(``--rolled-layers``: one layer body to compile, every layer at its real
size). Every collective of the optimized HLO is read with its kind, dtype,
bytes and replica group, counted once per trip of the loops around it, and
turned into the bytes each device sends or receives (ring algorithms:
an all-gather or reduce-scatter of a B-byte tensor over n devices moves
(n-1)/n B per device, an all-reduce twice that).

Beside the bytes, a projected step time from a stated model (a projection,
not a measurement): the one-GPU compute time measured on the H200, NVLink and
inter-node bandwidths as assumptions, and a share of compute that hides the
FSDP collectives (:data:`MODEL`).

    PYTHONPATH=src JAX_PLATFORMS=cpu python bench/scale_paper.py --out results.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import re
import sys
import time

import jax
import jax.numpy as jnp

from fp8jax.verify import _hlo

# ----------------------------------------------------------------------------
# Reading collectives from optimized HLO
# ----------------------------------------------------------------------------

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)?\}")
_PAIRS = re.compile(r"source_target_pairs=\{(\{\d+,\d+\}(?:,\{\d+,\d+\})*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One array a collective moves, per device, counted ``count`` times a step.

    ``shape``/``dtype`` are the full tensor's (the gathered one for an
    all-gather, the unscattered one for a reduce-scatter); ``group`` the
    devices taking part; ``groups`` the replica groups (device ids) of the first kind.
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    group: int
    count: int
    op_name: str
    first_group: tuple[int, ...] = ()

    @property
    def full_bytes(self) -> int:
        return _hlo.TensorType(self.dtype, self.shape).nbytes

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends (= receives) for one instance, ring algorithm."""
        n = self.group
        if n <= 1:
            return 0.0
        if self.kind == "all-reduce":
            return 2 * (n - 1) / n * self.full_bytes
        if self.kind == "collective-permute":
            return float(self.full_bytes)
        return (n - 1) / n * self.full_bytes

    @property
    def step_bytes(self) -> float:
        return self.count * self.wire_bytes


def _kind(module: _hlo.Module, inst: _hlo.Instruction) -> str | None:
    kind = inst.opcode.removesuffix("-start")
    if inst.opcode == "async-start" and inst.called:
        kind = module.computations[inst.called[0]].root.opcode
    return kind if kind in KINDS else None


def _groups(attrs: str, partitions: int) -> tuple[int, tuple[int, ...]]:
    """(group size, the first group's device ids) from ``replica_groups``."""
    iota = _GROUPS_IOTA.search(attrs)
    if iota:
        # [groups, size]<=[dims]T(perm): the first group is not needed for its size;
        # the ids are rebuilt from the iota so that the span (intra/inter node) is known.
        return int(iota.group(2)), _iota_first_group(attrs, iota)
    listed = _GROUPS_LIST.search(attrs)
    if listed and listed.group(1):
        first = tuple(int(x) for x in listed.group(1).split("}")[0].strip("{").split(",") if x)
        return len(first), first
    pairs = _PAIRS.search(attrs)
    if pairs:
        return 2, tuple(int(x) for x in pairs.group(1).split("}")[0].strip("{").split(","))
    return partitions, tuple(range(partitions))


def _iota_first_group(attrs: str, iota: re.Match) -> tuple[int, ...]:
    import numpy as np

    spec = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
    m = spec.search(attrs)
    groups, size = int(m.group(1)), int(m.group(2))
    dims = [int(d) for d in m.group(3).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(4):
        ids = ids.transpose([int(p) for p in m.group(4).split(",")])
    return tuple(int(i) for i in ids.reshape(groups, size)[0])


def _arrays(module, comp, inst, kind) -> list[_hlo.TensorType]:
    """The full tensors a collective moves, one per array (tuples flattened)."""
    inputs = [t for op in inst.operands for t in comp.instructions[op].types[:1]]
    if kind == "reduce-scatter":
        return inputs
    outputs = list(inst.types)
    if inst.opcode.endswith("-start") and inst.opcode != "async-start":
        done = next((u for u in comp.users.get(inst.name, ()) if u.opcode.endswith("-done")), None)
        outputs = list(done.types) if done else outputs[len(outputs) // 2 :]
    elif inst.opcode == "async-start":
        done = next((u for u in comp.users.get(inst.name, ()) if u.opcode == "async-done"), None)
        outputs = list(done.types) if done else outputs[-len(inputs) :]
    return outputs


def read_collectives(hlo_text: str) -> list[Collective]:
    """Every collective array of an optimized HLO module, with how often a step runs it.

    A collective inside a ``while`` body counts once per trip
    (``known_trip_count``); one inside a loop of unknown trip count raises.
    """
    module = _hlo.parse_module(hlo_text)
    found: list[Collective] = []

    def walk(comp: _hlo.Computation, count: int, seen: tuple[str, ...]) -> None:
        for inst in comp.instructions.values():
            kind = _kind(module, inst)
            if kind is not None:
                group, first = _groups(inst.attrs, module.num_partitions)
                op_name = inst.metadata.get("op_name", "")
                for t in _arrays(module, comp, inst, kind):
                    found.append(Collective(kind, t.dtype, t.shape, group, count, op_name, first))
                continue
            if inst.opcode.endswith("-done") or inst.opcode == "async-start":
                continue
            inner = count
            if inst.opcode == "while":
                trips = _TRIP_COUNT.search(inst.attrs)
                if trips is None:
                    raise ValueError(f"while loop {inst.name} has no known trip count")
                inner = count * int(trips.group(1))
            for name in inst.called:
                if name in module.computations and name not in seen:
                    walk(module.computations[name], inner, (*seen, name))

    walk(module.entry, 1, (module.entry.name,))
    return found


def _tp_local(leaf) -> tuple[int, ...]:
    """A parameter's shape as FSDP gathers it: split by every mesh axis but ``fsdp``."""
    shape = list(leaf.shape)
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return tuple(shape)
    sizes = dict(sharding.mesh.shape)
    for dim, entry in enumerate(sharding.spec):
        for axis in entry if isinstance(entry, tuple) else (entry,) if entry else ():
            if axis != "fsdp":
                shape[dim] //= sizes[axis]
    return tuple(shape)


def param_shapes(params) -> dict[tuple[int, ...], tuple[str, ...]]:
    """Sorted-dims key -> parameter name, for each parameter and each of its layer slices.

    ``params`` may carry shardings; a parameter's shape is then its
    tensor-parallel shard's, the tensor FSDP gathers. A gathered kernel may be
    the transposed copy (FP8 dgrad) or one layer of the stack (inside the
    rolled loop), so shapes match by their sorted dims.
    """
    shapes: dict[tuple[int, ...], tuple[str, ...]] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        shape = _tp_local(leaf)
        keys = [tuple(sorted(shape))] + ([tuple(sorted(shape[1:]))] if "blocks" in name else [])
        for key in keys:
            shapes[key] = (*shapes.get(key, ()), name)
    return shapes


def label(rows: list[dict], shapes: dict[tuple[int, ...], tuple[str, ...]]) -> None:
    """Sets each row's ``role`` and ``param`` (:func:`classify`)."""
    for row in rows:
        c = Collective(row["kind"], row["dtype"], tuple(row["shape"]), row["group"],
                       row["count"], row["op_name"])  # fmt: skip
        row["role"], row["param"] = classify(c, shapes)


def _squeeze(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(d for d in shape if d != 1))


def _pick(names: tuple[str, ...], op_name: str) -> str:
    """Of parameters of one shape (embedding and LM head), those ``op_name`` names.

    XLA may merge the op names of several ops into one; then every named one is kept.
    """
    named = [n for n in names if n.split("/")[0] in op_name] or list(names[:1])
    return " or ".join(named)


def classify(c: Collective, shapes: dict[tuple[int, ...], tuple[str, ...]]) -> tuple[str, str]:
    """(role, parameter) of a collective: a weight gather, a gradient reduction or other.

    Matched by the sorted dims; a reduce-scatter also by the element count
    (XLA may merge a kernel's dims, e.g. SwiGLU's (embed, 2, mlp) reduce-scattered
    as (embed, 2*mlp)), which an activation's all-reduce could share by chance.
    """
    keys = {_squeeze(k): v for k, v in shapes.items()}
    name = _pick(keys.get(_squeeze(c.shape), ()), c.op_name)
    if not name and c.kind == "reduce-scatter" and len(c.shape) > 1:
        sizes = {math.prod(k): v for k, v in sorted(shapes.items(), reverse=True)}
        name = _pick(sizes.get(math.prod(c.shape), ()), c.op_name)
    if name and c.kind == "all-gather":
        return "weight gather", name
    if name and c.kind in ("reduce-scatter", "all-reduce") and len(c.shape) > 1:
        return "gradient reduction", name
    return "other", name


# Why a weight gather of an FP8 step stays in a wide dtype, by the parameter's name.
WHY_WIDE = {
    "embed/embedding": "the embedding is a table lookup, not a GEMM: nothing to quantize",
    "lm_head/kernel": "the LM head's GEMM runs in BF16 in the FP8 step (the logits feed the loss)",
    "scale": "a norm's scale vector: elementwise math, kept in f32",
}


def why_wide(name: str) -> str:
    """Why the FP8 step gathers ``name`` (one parameter, or several joined by " or ") wide."""
    reasons = []
    for part in name.split(" or "):
        reason = next((r for key, r in WHY_WIDE.items() if part.endswith(key)), None)
        reasons.append(reason or "UNEXPLAINED: an FP8 GEMM's kernel should be gathered in FP8")
    return "; ".join(dict.fromkeys(reasons))


# ----------------------------------------------------------------------------
# The steps
# ----------------------------------------------------------------------------


def llama3_8b():
    from fp8jax.models.gpt import GptConfig

    # Llama-3-8B's shape, with its 128256-token vocabulary (fp8jax's presets use bytes).
    return GptConfig(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab_size=128256)


def models():
    from fp8jax.training.config import PRESETS

    return {
        "llama-3b": PRESETS["llama-3b"].model,
        "llama-3-8b": llama3_8b(),
        "medium": PRESETS["medium"].model,  # for the check against two H200s (--check)
    }


# The one multi-GPU measurement: GPT medium under --mesh fsdp=2 on two H200s
# (docs/design.md#fsdp-gathers-fp8, docs/train.md): FP8 1.03x (delayed scaling,
# layers unrolled, 410 k against 398 k tokens/s) to 1.21x BF16 (layers rolled).
# Its one-GPU step (BENCHMARKS.md, "Train step", h200-2026-11-30-n/: 32 x 1024
# bytes, delayed scaling): 280,260 against 216,651 tokens/s.
MEDIUM_ONE_GPU_MS = {"fp8": 32 * 1024 / 280_260 * 1e3, "bf16": 32 * 1024 / 216_651 * 1e3}
MEDIUM_TWO_GPU_GAIN = (1.03, 1.21)


def check_two_h200(result: dict) -> str:
    """The projection for medium on two GPUs (NVLink), against what two H200s measured."""
    steps = {}
    for precision in ("fp8", "bf16"):
        compute = MEDIUM_ONE_GPU_MS[precision]
        fsdp = sum(_comm_ms(r) for r in result[precision] if r["role"] in FSDP_ROLES)
        other = sum(_comm_ms(r) for r in result[precision] if r["role"] not in FSDP_ROLES)
        steps[precision] = (compute, fsdp, compute + max(0.0, fsdp - MODEL["overlap"] * compute))
        steps[precision] = (*steps[precision][:2], steps[precision][2] + other)
    gain = steps["bf16"][2] / steps["fp8"][2]
    one = MEDIUM_ONE_GPU_MS["bf16"] / MEDIUM_ONE_GPU_MS["fp8"]
    return (
        f"check: medium, fsdp=2, NVLink: FSDP traffic {steps['fp8'][1]:.2f} ms (FP8) and "
        f"{steps['bf16'][1]:.2f} ms (BF16) under {steps['fp8'][0]:.0f} and "
        f"{steps['bf16'][0]:.0f} ms of compute: projected gain {gain:.3f}, the one-GPU "
        f"{one:.3f}; measured on two H200s {MEDIUM_TWO_GPU_GAIN[0]}-{MEDIUM_TWO_GPU_GAIN[1]}x. "
        "The model has the bytes hide, so what it misses at two GPUs is not bandwidth."
    )


SEQ_LEN = 4096
SIZES = (8, 64, 512)
GPUS_PER_NODE = 8
LAYOUTS = {"fsdp": lambda n: {"fsdp": n, "tp": 1}, "fsdp_tp": lambda n: {"fsdp": n // 8, "tp": 8}}


def build_step(model_cfg, precision: str, axes: dict[str, int], seq_len: int = SEQ_LEN):
    """(step, (state, batch) abstract and sharded, params) of ``fp8jax train``'s step on ``axes``.

    One ``seq_len``-byte sequence per data-parallel rank; the tensor-parallel ranks share it.
    """
    import flax.linen as nn
    import optax
    from jax.sharding import AbstractMesh, AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import fp8jax
    import fp8jax.sharding as fs
    from fp8jax.flax import TrainState, make_train_step
    from fp8jax.models import Gpt, next_token_loss
    from fp8jax.training.config import TrainOptions, resolve

    config = fs.ShardingConfig(dp="dp", fsdp="fsdp", tp="tp")
    mesh = AbstractMesh(
        (1, axes["fsdp"], axes["tp"]), ("dp", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3
    )
    model = Gpt(
        config=model_cfg,
        precision=precision,
        recipe=fp8jax.CurrentScaling() if precision == "fp8" else None,
        attention_implementation="xla",  # cuDNN's kernel cannot load without a GPU
        unroll_layers=False,
    )
    tx = resolve(TrainOptions(out="unused", config="llama-3b")).optimizer()
    batch = axes["fsdp"]
    tokens = jnp.zeros((batch, seq_len), jnp.int32)
    boxed = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    params_sharding = fs.variable_shardings(boxed, mesh, config)

    def create(key):
        return TrainState.create(nn.meta.unbox(model.init(key, tokens)), tx)

    state = jax.eval_shape(create, jax.random.key(0))
    replicated = NamedSharding(mesh, P())
    shardings = jax.tree.map(lambda _: replicated, state)._replace(params=params_sharding)
    opt = optax.tree_map_params(
        tx,
        lambda _, s: s,
        state.opt_state,
        params_sharding,
        transform_non_params=lambda _: replicated,
    )
    shardings = shardings._replace(opt_state=opt)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings
    )
    batch_sds = jax.ShapeDtypeStruct(
        (batch, seq_len + 1), jnp.int32, sharding=NamedSharding(mesh, P(("dp", "fsdp"), None))
    )

    def loss(variables, b):
        return next_token_loss(model.apply(variables, b[:, :-1]), b[:, 1:])

    return make_train_step(loss, tx), (abstract, batch_sds), state.params, mesh, config


@contextlib.contextmanager
def tracing(mesh, config):
    """fp8jax.sharding.use_mesh's context on an abstract mesh: its rules and batch axes."""
    from flax.core import spmd

    from fp8jax import kernels

    with (
        jax.sharding.use_abstract_mesh(mesh),
        spmd.logical_axis_rules(config.logical_rules()),
        kernels.data_parallel(config.batch_axes),
        jax.numpy_dtype_promotion("standard"),
    ):
        yield


def compile_pair(model_cfg, n: int, layout: str, seq_len: int = SEQ_LEN) -> dict:
    """Both precisions' collectives for ``n`` H100s under ``layout``."""
    from fp8jax import verify, xla_options

    axes = LAYOUTS[layout](n)
    calls, mesh, config = [], None, None
    for precision in ("fp8", "bf16"):
        step, args, _, mesh, config = build_step(model_cfg, precision, axes, seq_len)
        calls.append((step, args))
    start = time.perf_counter()
    with tracing(mesh, config):
        hlos = verify.compile_many(
            calls,
            target="h100",
            devices=n,
            hosts=max(1, n // GPUS_PER_NODE),
            xla_flags=xla_options.as_xla_flags(),
        )
    seconds = time.perf_counter() - start
    out = {"axes": axes, "compile_s": round(seconds, 1)}
    for precision, hlo in zip(("fp8", "bf16"), hlos, strict=True):
        rows = []
        for c in read_collectives(hlo):
            span = "inter" if len({d // GPUS_PER_NODE for d in c.first_group}) > 1 else "intra"
            rows.append(
                {
                    "kind": c.kind, "dtype": c.dtype, "shape": c.shape, "group": c.group,
                    "count": c.count, "bytes": c.step_bytes, "span": span, "op_name": c.op_name,
                }
            )  # fmt: skip
        out[precision] = rows
    relabel(out, model_cfg, seq_len)
    return out


def relabel(result: dict, model_cfg, seq_len: int = SEQ_LEN) -> None:
    """Names the parameter and role of every collective of ``result`` (nothing compiles)."""
    _, (state, _), _, _, _ = build_step(model_cfg, "bf16", result["axes"], seq_len)
    shapes = param_shapes(state.params)
    for precision in ("fp8", "bf16"):
        label(result[precision], shapes)


# ----------------------------------------------------------------------------
# The projection
# ----------------------------------------------------------------------------

MODEL = {
    # BENCHMARKS.md, "Train step": llama-3b, 8 x 4096 bytes a step on one H200
    # (bench/results/h200-2026-12-05/): FP8 current scaling 775.51 ms, BF16 1148.97 ms.
    "h200_llama3b_step_ms": {"fp8": 775.51, "bf16": 1148.97},
    "sequences_per_gpu": 8,  # that measurement's batch; every GPU keeps it (weak scaling)
    "nvlink_GBps": 900.0,  # per GPU, within a node of 8 (NVLink 4), stated
    "internode_GBps_per_gpu": 8 * 400 / 8 / 8,  # 8 x 400 Gb/s NICs per 8-GPU node: 50 GB/s a GPU
    # FSDP gathers and gradient reductions run on their own stream under the
    # compute; at most this share of the compute time can hide them (the first
    # gather and the last reduction cannot hide, and NCCL takes SMs). Every other
    # collective (TP's activation all-reduces, amax maxima) is on the critical path.
    "overlap": 0.8,
}
FSDP_ROLES = ("weight gather", "gradient reduction")


def flops_per_sequence(model_cfg) -> float:
    from fp8jax.training import mfu

    return mfu.flops_per_token(model_cfg, SEQ_LEN) * SEQ_LEN


def _comm_ms(row: dict) -> float:
    bw = MODEL["nvlink_GBps"] if row["span"] == "intra" else MODEL["internode_GBps_per_gpu"]
    return row["bytes"] / (bw * 1e9) * 1e3


def project(result: dict, flops_scale: float, bf16_gradients: bool = False) -> dict:
    """Projected ms a step per precision: compute, plus collectives that do not hide.

    The compile holds one sequence per data-parallel rank; at the modelled
    batch (``sequences_per_gpu`` on every GPU, so ``tp`` times that per rank)
    the weights' bytes stay and the activations' grow with the sequences.
    ``bf16_gradients``: the FP8 step's f32 gradient reductions counted at BF16's
    2 bytes (what a BF16 wgrad output would move).
    """
    axes = result["axes"]
    sequences = MODEL["sequences_per_gpu"] * axes["tp"]
    out = {}
    for precision in ("fp8", "bf16"):
        compute = MODEL["h200_llama3b_step_ms"][precision] * flops_scale
        fsdp = exposed = 0.0
        for row in result[precision]:
            ms = _comm_ms(row)
            if row["role"] in FSDP_ROLES:
                if bf16_gradients and row["role"] == "gradient reduction" and row["dtype"] == "f32":
                    ms /= 2
                fsdp += ms
            else:
                exposed += ms * sequences
        step = compute + max(0.0, fsdp - MODEL["overlap"] * compute) + exposed
        out[precision] = {
            "compute_ms": compute, "fsdp_comm_ms": fsdp, "exposed_comm_ms": exposed,
            "step_ms": step,
        }  # fmt: skip
    out["gain"] = out["bf16"]["step_ms"] / out["fp8"]["step_ms"]
    # The batch below which the FP8 step's FSDP traffic no longer hides under its compute.
    per_sequence = out["fp8"]["compute_ms"] / MODEL["sequences_per_gpu"]
    out["fp8_hides_from_sequences_per_gpu"] = out["fp8"]["fsdp_comm_ms"] / (
        MODEL["overlap"] * per_sequence
    )
    return out


# ----------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------


def summarize(result: dict) -> dict:
    """Per-device bytes a step, by role and precision, and the wide gathers of the FP8 step."""
    out = {}
    for precision in ("fp8", "bf16"):
        roles: dict[str, float] = {}
        for row in result[precision]:
            roles[row["role"]] = roles.get(row["role"], 0.0) + row["bytes"]
        out[precision] = roles
    wide = {}
    for row in result["fp8"]:
        if row["role"] == "weight gather" and not row["dtype"].startswith("f8"):
            wide.setdefault(row["param"], [row["dtype"], 0.0, why_wide(row["param"])])
            wide[row["param"]][1] += row["bytes"]
    out["wide_gathers"] = wide
    fp8_g, bf16_g = out["fp8"].get("weight gather", 0), out["bf16"].get("weight gather", 0)
    out["gather_ratio"] = fp8_g / bf16_g if bf16_g else float("nan")
    total = lambda p: sum(out[p].values())  # noqa: E731
    out["total_ratio"] = total("fp8") / total("bf16")
    return out


def _line(name, n, layout, result, s, p, p16) -> str:
    g = lambda prec, role: s[prec].get(role, 0.0) / 1e9  # noqa: E731
    ratio = "-" if math.isnan(s["gather_ratio"]) else f"{s['gather_ratio']:.3f}"
    return (
        f"{name:<11} {n:>4} {layout:<8} "
        f"{g('fp8', 'weight gather'):>6.2f}/{g('bf16', 'weight gather'):<6.2f} {ratio:>6} "
        f"{g('fp8', 'gradient reduction'):>6.2f}/{g('bf16', 'gradient reduction'):<6.2f} "
        f"{g('fp8', 'other'):>6.3f}/{g('bf16', 'other'):<6.3f} {s['total_ratio']:>6.3f} | "
        f"{p['fp8']['step_ms']:>7.1f}/{p['bf16']['step_ms']:<7.1f} {p['gain']:>6.3f} "
        f"{p16['gain']:>6.3f} {p['fp8_hides_from_sequences_per_gpu']:>6.2f} "
        f"{p16['fp8_hides_from_sequences_per_gpu']:>6.2f} "
        f"{result.get('compile_s', 0):>6.1f}"
    )


HEADER = (
    f"{'model':<11} {'GPUs':>4} {'layout':<8} {'gathers f8/bf':>13} {'ratio':>6} "
    f"{'grads f8/bf':>13} {'other f8/bf':>13} {'all':>6} | "
    f"{'step ms f8/bf':>15} {'gain':>6} {'gain*':>6} {'b_min':>6} {'b_min*':>6} {'comp s':>6}"
)
LEGEND = """\
columns: GB each device moves a step (ring algorithms), FP8 / BF16 step:
  gathers: the weights' all-gathers; ratio: FP8 over BF16 (target <= 0.55)
  grads: the gradients' reduce-scatters/all-reduces; other: every other collective
  all: FP8 over BF16, every collective
projection (a model, not a measurement; --help and MODEL say how):
  step ms, gain: projected step time and BF16/FP8 at 8 sequences per GPU; b_min: sequences
  per GPU below which the FP8 step's FSDP traffic stops hiding under its compute (and its
  gain falls below the one-GPU gain); gain*, b_min*: the same with the FP8 step's f32
  gradients reduced in BF16; comp s: seconds of the deviceless compile of both steps"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama-3b", "llama-3-8b"])
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--out", help="write every row and the summary as JSON here")
    parser.add_argument("--load", help="re-read the compiles from an --out JSON, compile nothing")
    parser.add_argument(
        "--check", action="store_true", help="also compile medium for 2 GPUs (fsdp=2) and "
        "compare the projection with the two-H200 measurement",
    )  # fmt: skip
    args = parser.parse_args(argv)
    all_models = models()
    loaded = {}
    if args.load:
        with open(args.load) as f:
            loaded = {(r["model"], r["gpus"], r["layout"]): r for r in json.load(f)["results"]}
    print(LEGEND)
    print(f"assumptions: {json.dumps(MODEL)}")
    print(HEADER, flush=True)
    results = []
    for model_name in args.models:
        cfg = all_models[model_name]
        scale = flops_per_sequence(cfg) / flops_per_sequence(all_models["llama-3b"])
        for n in args.sizes:
            for layout in args.layouts:
                key = (model_name, n, layout)
                if args.load:  # rows as compiled; roles from this version of classify
                    result = loaded[key]
                    relabel(result, cfg)
                else:
                    result = compile_pair(cfg, n, layout)
                s, p = summarize(result), project(result, scale)
                p16 = project(result, scale, bf16_gradients=True)
                print(_line(model_name, n, layout, result, s, p, p16), flush=True)
                for param, (dtype, nbytes, why) in s["wide_gathers"].items():
                    print(f"    FP8 step gathers {param} in {dtype} ({nbytes / 1e9:.3f} GB): {why}")
                keep = {k: result[k] for k in ("axes", "compile_s", "fp8", "bf16")}
                results.append(
                    {"model": model_name, "gpus": n, "layout": layout, "summary": s,
                     "projection": p, "projection_bf16_gradients": p16, **keep}
                )  # fmt: skip
    ms = MODEL["h200_llama3b_step_ms"]
    print(f"one-GPU gain (H200, measured, llama-3b): {ms['bf16'] / ms['fp8']:.3f}")
    if args.check:
        key = ("medium", 2, "fsdp")
        if key in loaded:
            medium = loaded[key]
            relabel(medium, all_models["medium"])
        else:
            medium = compile_pair(all_models["medium"], 2, "fsdp")
        results.append({"model": "medium", "gpus": 2, "layout": "fsdp", **medium})
        print(check_two_h200(medium))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": MODEL, "results": results}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

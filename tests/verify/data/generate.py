"""Regenerates the HLO samples in this folder: ``python tests/verify/data/generate.py``.

``--check`` compiles the samples of fp8jax's own programs again and compares
the structural facts the tests read from them (the GEMM report, the FP8
relayouts, bench/breakdown.py's kernel classes) with the committed files;
test_samples_current.py runs it, so a library change that alters the compiled
program fails until the samples are regenerated. ``--out DIR`` writes to DIR.

On a GPU machine, ``python tests/verify/data/generate.py --live DIR`` writes
the live samples (``h200_live_*.hlo.txt``) to DIR and prints their reports;
their expectations are then written by reading the HLO.

Each sample is ``NAME.hlo.txt`` plus ``NAME.expect.json``. The expectations
are written here by hand, from reading the HLO, and the script refuses to write
a sample whose report disagrees with them: the parser is checked against what
a person saw, not against itself. test_report.py checks every pair in this
folder, so a sample from a real GPU only needs its two files (see README.md).
"""

import dataclasses
import json
import os
import pathlib
import sys
from typing import Any

if "--live" not in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[2] / "bench"))

import breakdown  # noqa: E402
import verify_programs as programs  # noqa: E402

from fp8jax.verify import compile_for, fp8_relayouts, gemm_report  # noqa: E402

TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
E4, E5 = "f8e4m3fn", "f8e5m2"


def fp8_trio(backend: str) -> list:
    """Forward E4M3 x E4M3, wgrad E4M3 x E5M2, dgrad E5M2 x E4M3."""
    return [[backend, E4, E4, False], [backend, E4, E5, False], [backend, E5, E4, False]]


@dataclasses.dataclass
class Sample:
    name: str
    description: str
    fn: Any
    args: tuple
    gemms: list  # sorted [backend, lhs dtype, rhs dtype, upcast_from_fp8]
    collectives: list = dataclasses.field(default_factory=list)  # sorted [kind, dtype]
    compile_kw: dict = dataclasses.field(default_factory=dict)


def _ep_mesh():
    return AbstractMesh((8,), (programs.EP_AXIS,), axis_types=(AxisType.Auto,))


def _fsdp_mesh():
    return AbstractMesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))


GRADS_FSDP = (P(), (programs.FSDP, programs.FSDP))
SAMPLES = [
    Sample("h100_dense_default", "fp8jax.dense fwd+bwd, 1 H100, default flags: each FP8 dot "
           "names its FP8 algorithm, which Triton does not take",
           programs.fp8_train_step, programs.args(), fp8_trio("cublaslt-fp8")),
    Sample("h200_dense_cublas", "fp8jax.dense fwd+bwd, 1 H200, Triton GEMMs off",
           programs.fp8_train_step, programs.args(), fp8_trio("cublaslt-fp8"),
           compile_kw={"target": "h200", "xla_flags": TRITON_OFF}),
    Sample("h100_dense_fsdp8_default", "fp8jax.dense fwd+bwd, 8 H100, FSDP, default flags: "
           "XLA's Shardy round trip drops the forward dot's algorithm, which Triton then takes",
           programs.fp8_train_step, programs.args(_fsdp_mesh()),
           [["cublaslt-fp8", E4, E5, False], ["cublaslt-fp8", E5, E4, False],
            ["triton-fp8", E4, E4, False]],
           [["all-gather", E4], ["all-reduce", "bf16"], ["all-reduce", "f32"],
            ["all-reduce", "f32"], ["all-reduce", "f32"], ["reduce-scatter", "f32"]],
           {"devices": 8, "out_shardings": GRADS_FSDP}),
    Sample("h200_dense_fsdp8_2hosts_cublas", "fp8jax.dense fwd+bwd, 2 hosts x 4 H200, FSDP, "
           "Triton GEMMs off", programs.fp8_train_step, programs.args(_fsdp_mesh()),
           fp8_trio("cublaslt-fp8"),
           [["all-gather", E4], ["all-reduce", "bf16"], ["all-reduce", "f32"],
            ["all-reduce", "f32"], ["all-reduce", "f32"], ["reduce-scatter", "f32"]],
           {"target": "h200", "devices": 8, "hosts": 2, "xla_flags": TRITON_OFF,
            "out_shardings": GRADS_FSDP}),
    Sample("h100_scan_cublas", "fp8jax.dense in lax.scan over 2 layers: GEMMs in while loops",
           programs.scanned_fp8_step, programs.scanned_args(), fp8_trio("cublaslt-fp8"),
           compile_kw={"xla_flags": TRITON_OFF}),
    Sample("h100_qdq_triton", "quantize-dequantize then BF16 dot: XLA drops the f8 round trip",
           programs.qdq_matmul, programs.args(), [["triton", "bf16", "bf16", False]]),
    Sample("h100_qdq_cublas", "quantize-dequantize then BF16 dot, Triton GEMMs off",
           programs.qdq_matmul, programs.args(), [["cublaslt", "bf16", "bf16", False]],
           compile_kw={"xla_flags": TRITON_OFF}),
    Sample("h100_bf16_triton", "plain BF16 dot", programs.bf16_matmul,
           programs.args(kernel_dtype=jnp.bfloat16), [["triton", "bf16", "bf16", False]]),
    Sample("h100_dequantized_kernel_triton", "f8 kernel converted to BF16 inside the Triton "
           "fusion, before its dot", programs.dequantized_kernel_matmul,
           programs.dequantized_args(), [["triton", "bf16", "bf16", True]]),
    Sample("h100_dequantized_kernel_cublas", "f8 kernel dequantized by a loop fusion feeding a "
           "BF16 cuBLASLt GEMM", programs.dequantized_kernel_matmul,
           programs.dequantized_args(), [["cublaslt", "bf16", "bf16", True]],
           compile_kw={"xla_flags": TRITON_OFF}),
    # FP8 rows exchanged as expert parallelism exchanges them (each device's
    # rows, by all-to-all and by ragged-all-to-all, with s32 counts) and as
    # tensor parallelism's ring passes shards (collective-permute): the
    # verifier must list each exchange with its FP8 dtype.
    Sample("h100_ep_exchange8", "FP8 rows by all-to-all and ragged-all-to-all, counts by "
           "all-to-all, in shard_map over 8 H100", programs.ep_exchange,
           programs.exchange_args(_ep_mesh()), [],
           [["all-to-all", E4], ["all-to-all", "s32"], ["ragged-all-to-all", E4]],
           {"devices": 8}),
    Sample("h100_tp_ring8", "FP8 shards passed around a ring of 8 H100 (collective-permute), "
           "in shard_map", programs.tp_ring, programs.exchange_args(_ep_mesh(), False), [],
           [["collective-permute", E4]] * 7,
           {"devices": 8}),
    Sample("cpu_dense", "fp8jax.dense fwd+bwd compiled for the CPU, which upcasts FP8 dots",
           programs.fp8_train_step, programs.args(),
           [["dot", "f32", "f32", True], ["dot", "f32", "f32", True],
            ["dot", "f32", "f32", True]],
           compile_kw={"target": "cpu"}),
]  # fmt: skip


# The samples whose program runs fp8jax's ops: a library change alters these,
# so --check recompiles them; the others change only with JAX.
FP8JAX_PROGRAMS = (programs.fp8_train_step, programs.scanned_fp8_step)

# Compiled on the GPU at hand; the autotuner picks each GEMM's backend.
LIVE = [
    ("h200_live_dense", programs.fp8_train_step, programs.args(), None),
    ("h200_live_dense_cublas", programs.fp8_train_step, programs.args(), TRITON_OFF),
    ("h200_live_attention", programs.attention_block_step, programs.attention_args(), None),
]


def write_live(folder: pathlib.Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    for name, fn, args, flags in LIVE:
        hlo = compile_for(fn, *args, target="live", xla_flags=flags)
        (folder / f"{name}.hlo.txt").write_text(hlo)
        print(f"== {name} (jax {jax.__version__}, XLA_FLAGS={flags!r})\n{gemm_report(hlo)}")
    return 0


def _compile(sample: Sample) -> str:
    kw = dict(sample.compile_kw)
    if kw.pop("target", None) == "cpu":
        return jax.jit(sample.fn).lower(*sample.args).compile().as_text()
    return compile_for(
        sample.fn, *sample.args, target=sample.compile_kw.get("target", "h100"), **kw
    )


def observed(report) -> dict[str, Any]:
    """The parts of a report the expectations pin down, in canonical order."""
    return {
        "fp8_gemms": len(report.fp8_gemms),
        "non_fp8_gemms": len(report.non_fp8_gemms),
        "gemms": sorted(
            [g.backend, g.lhs_dtype, g.rhs_dtype, g.upcast_from_fp8] for g in report.gemms
        ),
        "collectives": sorted([c.kind, c.dtype] for c in report.collectives),
        "attention": len(report.attention),
    }


def dump_expectation(expectation: dict[str, Any]) -> str:
    """JSON with one GEMM or collective per line, so diffs read row by row."""
    lines = []
    for key, value in expectation.items():
        if isinstance(value, list) and value:
            rows = ",\n".join(f"    {json.dumps(row)}" for row in value)
            lines.append(f'  "{key}": [\n{rows}\n  ]')
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _is_fp8(gemm: list) -> bool:
    return gemm[1].startswith("f8") and gemm[2].startswith("f8")


def structural_facts(hlo: str) -> dict[str, Any]:
    """What the tests read from a sample: report, relayouts and kernel classes.

    Exact text would also change with instruction numbering that no test
    reads; these facts change when the compiled program does.
    """
    return {
        **observed(gemm_report(hlo)),
        "fp8_relayouts": sorted(
            [r.dtype, list(r.shape), r.untiled_transpose] for r in fp8_relayouts(hlo)
        ),
        "kernel_classes": sorted(breakdown.fusion_classes(hlo).items()),
        "pallas_calls": hlo.count('custom_call_target="__gpu$xla.gpu.triton"'),
    }


def check(names: list[str]) -> int:
    """Compiles ``names`` (all samples of fp8jax's programs when empty) and
    compares their structural facts with the committed samples; 1 if any differ.
    """
    chosen = [s for s in SAMPLES if s.name in names] if names else [
        s for s in SAMPLES if s.fn in FP8JAX_PROGRAMS
    ]  # fmt: skip
    unknown = set(names) - {s.name for s in SAMPLES}
    if unknown:
        print(f"no sample named {sorted(unknown)}; samples: {[s.name for s in SAMPLES]}")
        return 2
    stale = 0
    for sample in chosen:
        committed = structural_facts((HERE / f"{sample.name}.hlo.txt").read_text())
        fresh = structural_facts(_compile(sample))
        if committed != fresh:
            stale += 1
            diff = {k: (committed[k], fresh[k]) for k in fresh if committed[k] != fresh[k]}
            print(f"{sample.name} is stale; (committed, fresh compile) differ in:")
            for key, (old, new) in diff.items():
                print(f"  {key}:\n    committed {old}\n    fresh     {new}")
        else:
            print(f"{sample.name} is current")
    if stale:
        print("Regenerate with: python tests/verify/data/generate.py, and commit the samples.")
    return 1 if stale else 0


def main(out: pathlib.Path = HERE) -> int:
    failed = 0
    for sample in SAMPLES:
        hlo = _compile(sample)
        gemms = sorted(sample.gemms)
        expected = {
            "fp8_gemms": sum(_is_fp8(g) for g in gemms),
            "non_fp8_gemms": sum(not _is_fp8(g) for g in gemms),
            "gemms": gemms,
            "collectives": sorted(sample.collectives),
            "attention": 0,
        }
        got = observed(gemm_report(hlo))
        if got != expected:
            print(
                f"{sample.name}: report disagrees with the expectation\n  expected {expected}"
                f"\n  got      {got}\nHLO:\n{hlo}"
            )
            failed += 1
            continue
        kw = sample.compile_kw
        producer = (
            f"jax {jax.__version__}, target={kw.get('target', 'h100')}, "
            f"devices={kw.get('devices', 1)}, hosts={kw.get('hosts', 1)}, "
            f"XLA_FLAGS={kw.get('xla_flags', '')!r}"
        )
        meta = {
            "description": sample.description,
            "producer": producer,
            "source_file": "verify_programs.py",
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{sample.name}.hlo.txt").write_text(hlo)
        (out / f"{sample.name}.expect.json").write_text(dump_expectation({**meta, **expected}))
        print(f"wrote {sample.name} ({len(hlo):,} chars)")
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--live"]:
        sys.exit(write_live(pathlib.Path(sys.argv[2])))
    if sys.argv[1:2] == ["--check"]:
        sys.exit(check(sys.argv[2:]))
    if sys.argv[1:2] == ["--out"]:
        sys.exit(main(pathlib.Path(sys.argv[2])))
    sys.exit(main())

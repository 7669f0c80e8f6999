"""Plants faults in a copy of fp8jax's quantization code and counts which ones the tests catch.

Each mutant is one textual replacement in a file under ``src/fp8jax``,
applied to a fresh copy of ``src/`` (never the checkout itself), which
is imported ahead of the installed package through PYTHONPATH. A mutant
is killed when the test run fails. Not part of the suite: run it by hand,
on the CPU:

    .venv/bin/python tests/mutation/run_mutants.py --tests tests/ops/test_dense.py ...

``--issue57`` runs the faults of issue 57 instead, each against the tests
written to catch it (``ISSUE_57``; no ``--tests`` needed):

    .venv/bin/python tests/mutation/run_mutants.py --issue57

``--tests-root`` runs test files from another copy of ``tests/`` (an older
commit's, from ``git archive``), to compare the suite before and after a change.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]

# (name, file under src/fp8jax, the text replaced, its replacement, how many occurrences)
MUTANTS = [
    ("dense: E5M2 for the forward input", "ops/dot_general.py",
     "quantize_operand(lhs, fmt, state and state.x, recipe,",
     "quantize_operand(lhs, recipe.formats.backward, state and state.x, recipe,", 1),
    ("dense: E4M3 for the output gradient", "ops/dot_general.py",
     "g, recipe.formats.backward, state and state.grad, recipe,",
     "g, recipe.formats.forward, state and state.grad, recipe,", 1),
    ("dense: the input's and kernel's amaxes swapped", "ops/dot_general.py",
     "amaxes = (lhs_q.amax, rhs_q.amax) if state", "amaxes = (rhs_q.amax, lhs_q.amax) if state", 1),
    ("current scaling: margin dropped", "ops/quantizing.py",
     "scale_from_amax(x_amax, fmt.max, recipe.margin, fallback=1.0)",
     "scale_from_amax(x_amax, fmt.max, 0, fallback=1.0)", 1),
    ("scale_from_amax: margin dropped", "scaling.py",
     "(jnp.float32(fp8_max) / amax) / jnp.float32(2.0**margin)",
     "(jnp.float32(fp8_max) / amax)", 1),
    ("delayed: this step's amax left out of the scale", "scaling.py",
     "window_amax = jnp.maximum(amax, older_max) if", "window_amax = older_max if", 1),
    ("delayed: max and most_recent swapped", "scaling.py",
     'if recipe.amax_compute_algo == "max" else amax',
     'if recipe.amax_compute_algo == "most_recent" else amax', 1),
    ("delayed: gradient scales from E4M3's max", "scaling.py",
     '{"x": "forward", "kernel": "forward", "grad": "backward"}',
     '{"x": "forward", "kernel": "forward", "grad": "forward"}', 1),
    ("quantize: no saturation", "quantize.py",
     "jnp.clip(scaled, -fmt.max, fmt.max)", "scaled", 1),
    ("quantize: amax of signed values", "quantize.py",
     "magnitude = jnp.abs(x)\n", "magnitude = x\n", 1),
    ("fused: E5M2 for the normalized input", "ops/_fused.py",
     "recipe, fmt = config.recipe, config.recipe.formats.forward\n    placement",
     "recipe, fmt = config.recipe, config.recipe.formats.backward\n    placement", 1),
    ("mlp: fc2.kernel's scale for the activation", "ops/layernorm_mlp.py",
     "fc2.x", "fc2.kernel", 4),
    ("mlp: the pre-activation's amax recorded for the activation", "ops/layernorm_mlp.py",
     "MlpAmaxes(normed.amax, k1_q.amax, h.amax, k2_q.amax)",
     "MlpAmaxes(normed.amax, k1_q.amax, jnp.max(jnp.abs(pre)).astype(jnp.float32), k2_q.amax)",
     1),
    ("mlp: fc2.grad's scale for the activation's gradient", "ops/layernorm_mlp.py",
     "fc1.grad", "fc2.grad", 2),
    ("mlp: E5M2 for the activation in fc2's wgrad", "ops/layernorm_mlp.py",
     "fmt, h_fmt = recipe.formats.backward, recipe.formats.forward",
     "fmt, h_fmt = recipe.formats.backward, recipe.formats.backward", 1),
]  # fmt: skip

# Issue 57's faults, each with the tests written to catch it: ``--issue57``
# runs every one of them against its own tests (``-k`` expression or None).
_FINE = "ops/test_fine_references.py"
ISSUE_57 = [
    ("ragged_dot: margin ignored", "ops/ragged_dot.py", "recipe.margin", "0", 2,
     [_FINE], "ragged"),
    ("block: a weight block's amax over its first 64 rows", "ops/fine_quantize.py",
     "block_amax = jnp.max(jnp.abs(blocks), axis=(2, 4), keepdims=True)",
     "block_amax = jnp.max(jnp.abs(blocks[:, :, : block // 2]), axis=(2, 4), keepdims=True)", 1,
     [_FINE], "block"),
    ("verify: all-to-all not counted as a collective", "verify/report.py",
     '    "all-to-all",\n', "", 1, ["verify/test_exchange_samples.py"], None),
    ("verify: collective-permute not counted", "verify/report.py",
     '    "collective-permute",\n', "", 1, ["verify/test_exchange_samples.py"], None),
    ("norm: epsilon dropped", "kernels/norm_rows.py", ", width) + epsilon)", ", width))", 1,
     ["kernels/test_norm_edge_rows.py"], None),
    ("delayed: the window keeps the entry it drops", "scaling.py",
     "older = history[:, :-1]", "older = history", 1, ["ops/test_recipe_references.py"],
     "delayed"),
    ("delayed: the window drops its oldest kept entry", "scaling.py",
     "older = history[:, :-1]", "older = history[:, :-2]", 1,
     ["ops/test_recipe_references.py"], "delayed"),
    ("mlp: fc2.grad's scale for the activation's gradient", "ops/layernorm_mlp.py",
     "fc1.grad", "fc2.grad", 2, ["ops/test_fused_kernels_reference.py"], "mlp"),
    ("mlp: the pre-activation's amax recorded for the activation", "ops/layernorm_mlp.py",
     "MlpAmaxes(normed.amax, k1_q.amax, h.amax, k2_q.amax)",
     "MlpAmaxes(normed.amax, k1_q.amax, jnp.max(jnp.abs(pre)).astype(jnp.float32), k2_q.amax)",
     1, ["ops/test_fused_kernels_reference.py"], "mlp"),
    ("erf gelu kernel: slope without x phi'(x)", "activations.py",
     "phi + x * _RSQRT_2PI * m.exp(-0.5 * x * x)", "phi", 1,
     ["ops/test_fused_kernels_reference.py"], "gelu"),
    ("ragged_dot: one scale for every expert", "ops/ragged_dot.py",
     "reshape(rhs.shape[0], -1), axis=1)\n",
     "reshape(rhs.shape[0], -1), axis=1)\n"
     "    expert_amax = jnp.broadcast_to(jnp.max(expert_amax), expert_amax.shape)\n", 1,
     [_FINE], "ragged"),
    ("ragged_dot: a group's scale boundary one row late", "kernels/grouped_gemm.py",
     'side="right").astype(jnp.int32)', 'side="left").astype(jnp.int32)', 1,
     [_FINE], "ragged"),
    ("rowwise: the row scale taken per tensor", "ops/fine_quantize.py",
     "jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)",
     "jnp.max(jnp.abs(x.astype(jnp.float32)), keepdims=True)", 1, [_FINE], "rowwise"),
    ("rowwise (cast kernels' path): the row maxima taken per tensor", "kernels/row_cast.py",
     "return jnp.max(row, axis=0), jnp.max(col, axis=0)",
     "return jnp.broadcast_to(jnp.max(row), row.shape[1:]), jnp.max(col, axis=0)", 1,
     [_FINE], "rowwise"),
    ("rowwise: E4M3 for the output gradient", "ops/rowwise.py",
     "recipe, fmt = config.recipe, config.recipe.formats.backward",
     "recipe, fmt = config.recipe, config.recipe.formats.forward", 1,
     ["ops/test_fine_scaling.py"], "fused_ops_are"),
    ("mx: scales not rounded to powers of two", "ops/mx.py",
     "quantize_tiles(x, fmt, BLOCK, 0, power_of_two=True)",
     "quantize_tiles(x, fmt, BLOCK, 0, power_of_two=False)", 1, [_FINE], "mx"),
    ("mx: the weight's E4M3 copy for the dgrad in the gradient's format", "ops/mx.py",
     "_blocks(jnp.swapaxes(b, 1, 2), fmt))",
     "_blocks(jnp.swapaxes(b, 1, 2), config.recipe.formats.backward))", 1, [_FINE], "mx"),
    ("block: the weight blocks' scales not rounded to powers of two", "ops/blockwise.py",
     "qb, sb = quantize_blocks(b, fmt, BLOCK, recipe.margin, recipe.power_of_two_scales)",
     "qb, sb = quantize_blocks(b, fmt, BLOCK, recipe.margin, False)", 1, [_FINE], "block"),
    ("fine fused mlp: the gated activation's second branch dropped", "ops/fine_fused.py",
     "return gated(pre, activations).astype(pre.dtype)",
     "return gated(pre[..., :1, :], activations[:1]).astype(pre.dtype)", 1,
     ["ops/test_fine_scaling.py"], "fused_ops_are"),
]  # fmt: skip


def _apply(src: pathlib.Path, file: str, old: str, new: str, count: int) -> None:
    path = src / "fp8jax" / file
    text = path.read_text()
    if text.count(old) != count:
        raise ValueError(f"{file}: expected {count} of {old!r}, found {text.count(old)}")
    path.write_text(text.replace(old, new))


def _run_tests(src: pathlib.Path, tests_root: pathlib.Path, tests: list[str], timeout: float,
               keyword: str | None = None):  # fmt: skip
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{tests_root}", JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:randomly", "-p",
               "no:cacheprovider", "-m", "not deviceless", "--rootdir", str(tests_root.parent),
               "-c", str(tests_root.parent / "pyproject.toml"),
               *(str(tests_root / t) for t in tests),
               *(["-k", keyword] if keyword else [])]  # fmt: skip
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=tests_root.parent)  # fmt: skip
    except subprocess.TimeoutExpired:
        return None, "timed out"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return done.returncode, (failed[0] if failed else (lines[-1] if lines else done.stderr[-300:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", nargs="+", help="paths under the tests root")
    parser.add_argument("--issue57", action="store_true",
                        help="issue 57's mutants, each against its own tests")  # fmt: skip
    parser.add_argument("--tests-root", default=str(REPO / "tests"))
    parser.add_argument("--only", nargs="*", type=int, help="mutant indices to run")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--src", default=str(REPO / "src"), help="the source tree to mutate")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    args = parser.parse_args()
    mutants = ISSUE_57 if args.issue57 else [(*m, None, None) for m in MUTANTS]
    if not args.issue57 and not args.tests:
        parser.error("--tests is required without --issue57")
    tests_root = pathlib.Path(args.tests_root).resolve()
    work = pathlib.Path(tempfile.mkdtemp(prefix="fp8jax-mutants-"))
    src = work / "src"
    check = subprocess.run(
        [sys.executable, "-c", "import fp8jax; print(fp8jax.__file__)"],
        env=dict(os.environ, PYTHONPATH=str(REPO / "src")), capture_output=True, text=True,
    )  # fmt: skip
    print("baseline import:", check.stdout.strip())
    killed = 0
    chosen = args.only if args.only is not None else range(len(mutants))
    if args.only == []:  # the unmutated source: the selection must pass
        rc, detail = _run_tests(pathlib.Path(args.src), tests_root, args.tests, args.timeout,
                                args.keyword)  # fmt: skip
        print("unmutated:", "passes" if rc == 0 else f"FAILS ({detail})")
    for i in chosen:
        name, file, old, new, count, own_tests, own_keyword = mutants[i]
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(args.src, src, ignore=shutil.ignore_patterns("*.egg-info"))
        _apply(src, file, old, new, count)
        imported = subprocess.run(
            [sys.executable, "-c", "import fp8jax; print(fp8jax.__file__)"],
            env=dict(os.environ, PYTHONPATH=str(src)), capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        if not imported.startswith(str(src)):
            raise RuntimeError(f"the mutated copy is not the one imported: {imported}")
        start = time.time()
        rc, detail = _run_tests(src, tests_root, args.tests or own_tests, args.timeout,
                                args.keyword or own_keyword)  # fmt: skip
        verdict = "killed" if rc not in (0, None) else "SURVIVED" if rc == 0 else "timeout"
        killed += verdict == "killed"
        print(f"[{i:2d}] {verdict:8s} {time.time() - start:6.0f}s  {name}: {detail}", flush=True)
    print(f"{killed} of {len(chosen)} mutants killed")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

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

``--round3`` runs the faults planted in this round's kernels and ops (FP8
attention, the block-scaled GEMM's builds, fused_adamw, moe_mlp's capacity
and aux loss), the same way (``ROUND_3``).

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
    ("fine-grained: E4M3 for the output gradient", "ops/fine_grained.py",
     "recipe, fmt = config.recipe, config.recipe.formats.backward",
     "recipe, fmt = config.recipe, config.recipe.formats.forward", 1,
     ["ops/test_fine_scaling.py"], "fused_ops_are"),
    ("mx: scales not rounded to powers of two", "recipes.py",
     'Granularity("tile", self.BLOCK, power_of_two=True)',
     'Granularity("tile", self.BLOCK, power_of_two=False)', 1, [_FINE], "mx"),
    ("mx: the weight's E4M3 copy for the dgrad in the gradient's format", "ops/fine_grained.py",
     '_quantize(jnp.swapaxes(b, 1, 2), fmt, recipe, "kernel", False)',
     '_quantize(jnp.swapaxes(b, 1, 2), recipe.formats.backward, recipe, "kernel", False)', 1,
     [_FINE], "mx"),
    ("block: the weight blocks' scales not rounded to powers of two", "ops/fine_quantize.py",
     "return quantize_blocks(x, fmt, block, margin, power_of_two)",
     "return quantize_blocks(x, fmt, block, margin, False)", 1, [_FINE], "block"),
    ("fine fused mlp: the gated activation's second branch dropped", "ops/fine_grained.py",
     "(pre, tuple(activations), -2, pre.dtype)",
     "(pre[..., :1, :], tuple(activations)[:1], -2, pre.dtype)", 1,
     ["ops/test_fine_scaling.py"], "fused_ops_are"),
]  # fmt: skip

# This round's kernels and ops (issue 57's last item), each fault against the
# tests written for it: ``--round3``. Where one fault touches several places
# (a head mapping read in three layouts), ``old`` and ``new`` are tuples of
# edits, each applied ``count`` times.
_ATT, _ATT_K = "ops/test_attention.py", "kernels/test_attention_kernel.py"
_FWD_K, _BWD_K = "kernel_in_interpret", "backward_kernels_in_interpret"
ROUND_3 = [
    ("attention: P not scaled by 2**8 before the E4M3 cast", "kernels/attention.py",
     "P_SCALE = 256.0", "P_SCALE = 1.0", 1, [_ATT], None),
    ("attention kernel: P cast to E4M3 unscaled (V's scale still divided)", "kernels/attention.py",
     "p_smem[...] = (p * P_SCALE).astype(FP8)", "p_smem[...] = p.astype(FP8)", 1,
     [_ATT_K], _FWD_K),
    ("attention: query head h reads kv head h % kv_heads (XLA forward)", "kernels/attention.py",
     ("q = jnp.transpose(q8.reshape(batch, tq, kv_heads, group, d), (0, 2, 3, 1, 4))",
      "qs = q_scale.reshape(batch, kv_heads, group, tq, 1)",
      "out = jnp.transpose(out, (0, 3, 1, 2, 4))",
      "lse2 = (m + jnp.log2(l)).reshape(batch, heads, tq)"),
     ("q = jnp.transpose(q8.reshape(batch, tq, group, kv_heads, d), (0, 3, 2, 1, 4))",
      "qs = jnp.swapaxes(q_scale.reshape(batch, group, kv_heads, tq, 1), 1, 2)",
      "out = jnp.transpose(out, (0, 3, 2, 1, 4))",
      "lse2 = jnp.swapaxes(m + jnp.log2(l), 1, 2).reshape(batch, heads, tq)"), 1, [_ATT], None),
    ("attention kernel: query head h reads kv head h % kv_heads", "kernels/attention.py",
     "kv_head = lax.div(head, jnp.array(group, head.dtype))",
     "kv_head = lax.rem(head, jnp.array(k_ref.shape[2], head.dtype))", 1, [_ATT_K], _FWD_K),
    ("attention backward: query head h reads kv head h % kv_heads (XLA)",
     "kernels/attention_backward.py",
     ("x = x.reshape(batch, t, kv_heads, heads // kv_heads, *x.shape[3:])\n"
      "    return jnp.moveaxis(x, 1, 3)",
      "dq = jnp.moveaxis(dq, 3, 1).reshape(batch, tq, heads, d)"),
     ("x = x.reshape(batch, t, heads // kv_heads, kv_heads, *x.shape[3:])\n"
      "    return jnp.moveaxis(jnp.swapaxes(x, 2, 3), 1, 3)",
      "dq = jnp.swapaxes(jnp.moveaxis(dq, 3, 1), 2, 3).reshape(batch, tq, heads, d)"), 1,
     [_ATT], None),
    ("attention dQ kernel: query head h reads kv head h % kv_heads",
     "kernels/attention_backward.py",
     "kv_head = lax.div(head, jnp.array(group, head.dtype))",
     "kv_head = lax.rem(head, jnp.array(k8_ref.shape[2], head.dtype))", 1, [_ATT_K], _BWD_K),
    ("attention dK/dV kernel: kv head's group taken as heads h % kv_heads",
     "kernels/attention_backward.py", "head = kv_head * group + t // per_head",
     "head = kv_head + (t // per_head) * k8_ref.shape[2]", 1, [_ATT_K], _BWD_K),
    ("attention: causal mask lets a row see the next key (XLA forward)", "kernels/attention.py",
     "jnp.where(rows >= cols + j * BLOCK, s, -jnp.inf)",
     "jnp.where(rows + 1 >= cols + j * BLOCK, s, -jnp.inf)", 1, [_ATT], None),
    ("attention backward: causal mask off by one (XLA)", "kernels/attention_backward.py",
     "jnp.where(rows >= cols + j * block, p, 0.0)",
     "jnp.where(rows + 1 >= cols + j * block, p, 0.0)", 1, [_ATT], None),
    ("attention kernel: causal mask off by one", "kernels/attention.py",
     "iota(shape, 0) + base >= iota(shape, 1) + j * BLOCK",
     "iota(shape, 0) + base + 1 >= iota(shape, 1) + j * BLOCK", 1, [_ATT_K], _FWD_K),
    ("attention dQ kernel: causal mask off by one", "kernels/attention_backward.py",
     "jnp.where(iota(shape, 0) + base >= key, p, 0.0)",
     "jnp.where(iota(shape, 0) + base + 1 >= key, p, 0.0)", 1, [_ATT_K], _BWD_K),
    ("attention dK/dV kernel: causal mask off by one", "kernels/attention_backward.py",
     "jnp.where(query >= iota(shape, 0) + base, pt, 0.0)",
     "jnp.where(query + 1 >= iota(shape, 0) + base, pt, 0.0)", 1, [_ATT_K], _BWD_K),
    ("attention: logsumexp saved in base e (XLA forward)", "kernels/attention.py",
     "lse2 = (m + jnp.log2(l)).reshape(batch, heads, tq)",
     "lse2 = ((m + jnp.log2(l)) / LOG2E).reshape(batch, heads, tq)", 1, [_ATT], None),
    ("attention kernel: logsumexp saved in base e", "kernels/attention.py",
     "lse_smem[...] = m + jnp.log2(l)", "lse_smem[...] = (m + jnp.log2(l)) / LOG2E", 1,
     [_ATT_K], _FWD_K),
    ("attention backward: dS without softmax's row term (XLA)", "kernels/attention_backward.py",
     "ds = (p * (dp - dl) * scale).astype(BF16)", "ds = (p * dp * scale).astype(BF16)", 1,
     [_ATT], None),
    ("attention dQ kernel: dS without softmax's row term", "kernels/attention_backward.py",
     "ds_w[wg] = (p * (dp - delta) * scale).astype(BF16)",
     "ds_w[wg] = (p * dp * scale).astype(BF16)", 1, [_ATT_K], _BWD_K),
    ("attention dK/dV kernel: dSᵀ without softmax's row term", "kernels/attention_backward.py",
     "dst = pt * (dpt - lax.broadcast_in_dim(load(dl_r.at[slot], column), shape, [1]))",
     "dst = pt * dpt", 1, [_ATT_K], _BWD_K),
    ("block kernel: scales_first reads the previous slice's scales", "kernels/block_gemm.py",
     ("plgpu.BlockSpec((1, CTA_M), lambda s: (s, 0)),",
      "plgpu.BlockSpec((1, tile_n), lambda s: (s, 0)),"),
     ("plgpu.BlockSpec((1, CTA_M), lambda s: (jnp.maximum(s - config.scales_first, 0), 0)),",
      "plgpu.BlockSpec((1, tile_n), lambda s: (jnp.maximum(s - config.scales_first, 0), 0)),"),
     1, ["kernels/test_block_gemm.py"], "interpret"),
    ("block kernel: the tile table ignores block boundaries", "kernels/block_gemm.py",
     'TILE_NS["blocks" if b_blocks else "rows"]', 'TILE_NS["rows"]', 1,
     ["kernels/test_block_gemm.py"], "tile_table"),
    ("fused_adamw: second moment's bias correction dropped", "optim.py",
     'nu_hat = nu_new / s["bc2"].astype(nu_new.dtype)', "nu_hat = nu_new", 1,
     ["test_optim.py"], "numpy"),
    ("fused_adamw: weight decay of the update, not the parameter", "optim.py",
     "update = update + weight_decay * p", "update = update + weight_decay * update", 1,
     ["test_optim.py"], "numpy"),
    ("fused_adamw: weight decay outside the learning rate", "optim.py",
     "        update = update + weight_decay * p\n"
     '    update = jnp.array(s["step_size"], dtype=update.dtype) * update\n',
     '        update = jnp.array(s["step_size"], dtype=update.dtype) * update - weight_decay * p\n'
     "    else:\n"
     '        update = jnp.array(s["step_size"], dtype=update.dtype) * update\n', 1,
     ["test_optim.py"], "numpy"),
    ("fused_adamw: clipping by each leaf's norm", "optim.py",
     'g = jax.lax.select(s["keep"], g, (g / s["g_norm"].astype(g.dtype)) * s["max_norm"])',
     'g = jnp.where(jnp.linalg.norm(g) < s["max_norm"], g, '
     'g / jnp.linalg.norm(g) * s["max_norm"])', 1, ["test_optim.py"], "numpy"),
    ("fused_adamw: the schedule read one step late", "optim.py",
     "step_size = -1 * learning_rate(lr_state.count)",
     "step_size = -1 * learning_rate(lr_state.count + 1)", 1, ["test_optim.py"], "numpy"),
    ("moe_mlp: capacity keeps each expert's last slots", "ops/moe.py",
     "rank = jnp.arange(flat.size, dtype=jnp.int32) - starts[sorted_experts]",
     "rank = starts[sorted_experts] + sizes[sorted_experts] - 1 - jnp.arange(flat.size)", 1,
     ["ops/test_moe_mlp.py"], "token_order"),
    ("moe_mlp: capacity counts the devices after this one first", "ops/moe.py",
     "earlier = jnp.arange(everyone.shape[0])[:, None] < me",
     "earlier = jnp.arange(everyone.shape[0])[:, None] > me", 1,
     ["sharding/test_moe_capacity.py"], "single_device"),
    ("moe_mlp: aux loss without its num_experts factor", "ops/moe.py",
     "aux_loss = num_experts * jnp.sum(load * mean_probs)",
     "aux_loss = jnp.sum(load * mean_probs)", 1, ["ops/test_moe_mlp.py"], "token_order"),
    ("moe_mlp: aux loss's mean probability not divided by the tokens", "ops/moe.py",
     "mean_probs = jnp.sum(probs, axis=0) / max(probs.shape[0], 1)",
     "mean_probs = jnp.sum(probs, axis=0)", 1, ["ops/test_moe_mlp.py"], "token_order"),
]  # fmt: skip


def _apply(src: pathlib.Path, file: str, old, new, count: int) -> None:
    path = src / "fp8jax" / file
    text = path.read_text()
    edits = zip(old, new, strict=True) if isinstance(old, tuple) else [(old, new)]
    for before, after in edits:
        if text.count(before) != count:
            raise ValueError(f"{file}: expected {count} of {before!r}, found {text.count(before)}")
        text = text.replace(before, after)
    path.write_text(text)


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
    parser.add_argument("--round3", action="store_true",
                        help="ROUND_3: this round's mutants, each against its tests")  # fmt: skip
    parser.add_argument("--tests-root", default=str(REPO / "tests"))
    parser.add_argument("--only", nargs="*", type=int, help="mutant indices to run")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--src", default=str(REPO / "src"), help="the source tree to mutate")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    args = parser.parse_args()
    own = ISSUE_57 if args.issue57 else ROUND_3 if args.round3 else None
    mutants = own or [(*m, None, None) for m in MUTANTS]
    if own is None and not args.tests:
        parser.error("--tests is required without --issue57 or --round3")
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
        # pytest's 5: no test selected, which catches nothing (an older tests root
        # may lack the tests a -k expression names).
        verdict = {0: "SURVIVED", None: "timeout", 5: "no tests"}.get(rc, "killed")
        killed += verdict == "killed"
        print(f"[{i:2d}] {verdict:8s} {time.time() - start:6.0f}s  {name}: {detail}", flush=True)
    print(f"{killed} of {len(chosen)} mutants killed")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Every bench script imports, parses ``--help``, and the cheap parts run on the CPU.

The scripts run on the H200 only, so a library change that breaks one (a
renamed helper, a quantizer returning another type) otherwise shows only
there, after a GPU start. Scripts with their own tests: test_<script>*.py.
"""

import contextlib
import importlib
import io
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from numerics import assert_within

ROOT = pathlib.Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "bench"))
SCRIPTS = sorted(p.stem for p in (ROOT / "bench").glob("*.py"))
LIBRARIES = {"harness", "clocks"}  # helpers the scripts import, with no command line
NO_ARGUMENTS = {"moe_mgpu_check"}  # main() runs the GPU check at once: imported only


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_script_imports_and_prints_its_help(name, monkeypatch):
    module = importlib.import_module(name)
    if name in LIBRARIES | NO_ARGUMENTS:
        return
    assert callable(getattr(module, "main", None)), f"bench/{name}.py has no main()"
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 0, out.getvalue()
    assert "usage:" in out.getvalue()


def _group_amax(v, rows, cols):
    """Each element's group maximum |v|, for groups of ``rows`` x ``cols`` elements."""
    r, c = v.shape
    amax = np.abs(v).reshape(r // rows, rows, c // cols, cols).max(axis=(1, 3))
    return np.repeat(np.repeat(amax, rows, axis=0), cols, axis=1)


def _e4m3_error(v, rows, cols, extra=0.0):
    """Elementwise bound on |dequantized E4M3 - v|, one scale 448 / amax per rows x cols group.

    Round to nearest with 3 mantissa bits errs by at most ``2**-4 |v|``; below
    the normal range by half the smallest subnormal (``2**-10``) over the scale.
    ``extra``: a further relative error of the operand the product is compared on.
    """
    return (2.0**-4 + extra) * np.abs(v) + 2.0**-10 * _group_amax(v, rows, cols) / 448


def _product_bound(a, b, ea, eb):
    """Elementwise bound on |XLA's sums of the FP8 products - a . b^T| (tests/numerics.py's form).

    ``ea . |b|^T + |a| . eb^T + ea . eb^T``, plus XLA's f32: the K-term sums and
    the scale multiplies, within ``(K + 4) 2**-24`` of the magnitude sums.
    """
    abs_ab = np.abs(a) @ np.abs(b).T
    bound = ea @ np.abs(b).T + np.abs(a) @ eb.T + ea @ eb.T
    return bound + (a.shape[1] + 4) * 2.0**-24 * (abs_ab + bound)


# Normwise the rounding error is statistical (tests/ops/test_dense.py derives
# it): 0.425 u relative RMS per E4M3 operand (u = 2**-4), sqrt(2) of that for
# a product of two, 0.0375; 0.045 allows 20%. A scale taken from the wrong
# tile or block errs by the ratio of two maxima, 0.2 here.
TYPICAL_E4M3_DOT_ERROR = 0.045


def _relative_error(got, want):
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.parametrize("b_blocks", [True, False])
def test_block_variants_operands_give_the_product_of_its_bf16_operands(b_blocks):
    """The kernel operands bench/block_variants.py builds, summed by XLA, are ``a . b^T``.

    Budget, elementwise: each operand is E4M3 per 1x128 tile (``b``: or per
    128x128 block) of the f32 values, whose bf16 copies ``a`` and ``b``
    are within ``2**-9`` of them, so the FP8 values lie within
    :func:`_e4m3_error` of the bf16 ones with ``2**-9`` more, all times
    ``1 + 2**-8`` (the f32 values, and their maxima, over the bf16 ones).
    """
    import block_variants

    m = n = k = 256
    (a16, b16), fp8_ops = block_variants.operands(m, n, k, b_blocks)
    qa, qb, sa, sb = fp8_ops
    assert qa.dtype == qb.dtype == fp8jax.E4M3.dtype, (qa.dtype, qb.dtype)
    assert sa.shape == (1, m, k // 128)
    assert sb.shape == ((1, n // 128, k // 128) if b_blocks else (1, n, k // 128))
    got = np.asarray(block_variants.xla_reference(fp8_ops, b_blocks), np.float64)[0]
    a, b = np.asarray(a16, np.float64), np.asarray(b16, np.float64)
    a = a[: block_variants.CHECK_ROWS]
    want = a @ b.T
    ea = (1 + 2.0**-8) * _e4m3_error(a, 1, 128, extra=2.0**-9)
    eb = (1 + 2.0**-8) * _e4m3_error(b, 128 if b_blocks else 1, 128, extra=2.0**-9)
    assert got.shape == want.shape
    assert_within(got, want, _product_bound(a, b, ea, eb), "block_variants")
    assert _relative_error(got, want) < TYPICAL_E4M3_DOT_ERROR


def test_mlp_flax_baseline_is_layernorm_dense_swiglu_dense():
    """bench/mlp.py's BF16 Flax block, against the same sums in f32 (bf16 roundings: 2**-6)."""
    import mlp

    block = mlp.FlaxMlp(ffn=32, activations=("silu", "linear"))
    x = jax.random.normal(jax.random.key(0), (8, 16)).astype(jnp.bfloat16)
    # Flax's LayerNorm mixes its f32 scale with bf16 inputs, as the script runs it.
    with jax.numpy_dtype_promotion("standard"):
        params = block.init(jax.random.key(1), x)
        got = np.asarray(block.apply(params, x), np.float32)
    p = jax.tree.map(lambda v: np.asarray(v, np.float32), params["params"])
    x32 = np.asarray(x, np.float32)
    mu, var = x32.mean(-1, keepdims=True), x32.var(-1, keepdims=True)
    y = (x32 - mu) / np.sqrt(var + 1e-6) * p["LayerNorm_0"]["scale"] + p["LayerNorm_0"]["bias"]
    pre = np.einsum("th,hgf->tgf", y, p["DenseGeneral_0"]["kernel"]) + p["DenseGeneral_0"]["bias"]
    h = pre[:, 0] / (1 + np.exp(-pre[:, 0])) * pre[:, 1]
    want = h @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
    np.testing.assert_allclose(got, want, rtol=2.0**-6, atol=2.0**-6 * np.abs(want).max())


def test_jaxpr_snapshot_prints_a_case_without_refusing_it(capsys):
    """bench/jaxpr_snapshot.py (CPU only) on one case that every recipe's op accepts."""
    import jaxpr_snapshot

    jaxpr_snapshot.main(["--only", "ragged_dot block kernels=off", "--hashes"])
    out = capsys.readouterr().out
    assert out.startswith("=== ragged_dot block kernels=off\n"), out
    assert "refused" not in out and "grad [1]" in out, out


def test_scaling_operands_summed_by_xla_give_the_product():
    """bench/scaling.py's operands (1x128 tiles, 128x128 blocks expanded per row) on XLA's sums.

    Budget as for block_variants above (x per 1x128 tile, w per 128x128
    block), against the f32 inputs themselves.
    """
    import scaling

    from fp8jax.kernels import block_gemm

    m = n = k = 256
    x, w, ops = scaling.operands(m, k, n)
    assert [o.shape for o in ops] == [(1, m, k), (1, n, k), (1, m, k // 128), (1, n, k // 128)]
    got = np.asarray(block_gemm.xla_block_matmul(*ops, out_dtype=jnp.float32), np.float64)[0]
    a, b = np.asarray(x, np.float64)[0], np.asarray(w, np.float64)[0]
    bound = _product_bound(a, b, _e4m3_error(a, 1, 128), _e4m3_error(b, 128, 128))
    assert_within(got, a @ b.T, bound, "scaling")
    assert _relative_error(got, a @ b.T) < TYPICAL_E4M3_DOT_ERROR


def test_attention_backward_precision_runs_at_a_toy_size():
    """bench/attention_backward_precision.py in a child: it switches jax_enable_x64 globally."""
    import os
    import subprocess

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'bench'}"}
    script = ROOT / "bench" / "attention_backward_precision.py"
    args = ["--seq", "128", "--heads", "1", "--head-dim", "64"]
    done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if " dq " in f" {line} "]
    assert len(rows) >= 2, done.stdout
    # Relative errors of FP8 or BF16 gradient products: finite, below E4M3's 2**-3 step.
    errors = [float(r[i + 1]) for r in rows for i in range(1, len(r), 2)]
    assert all(0 <= e < 2**-3 for e in errors), done.stdout


def test_mlp_rows_check_their_gradients_and_the_bias_free_block_has_no_unused_biases(
    monkeypatch,
):
    """bench/mlp.py's rows at a toy size: each passes the harness's non-zero gradient check.

    The bias-free variant once carried b1 and b2 as parameters it never used,
    whose gradients are zeros: the check refuses such a row.
    """
    import harness
    import mlp

    monkeypatch.setitem(harness._heat, "seconds", 0.0)
    names = ["bf16", "fp8jax_delayed", "fp8jax_delayed_nobias", "gemms_only"]
    with jax.numpy_dtype_promotion("standard"):  # Flax's LayerNorm mixes f32 and bf16
        rows = mlp.run_case(64, 32, 64, ("silu", "linear"), iters=1, names=names)
    checked = {r["name"]: r["gradient_leaves_checked"] for r in rows}
    # bf16: LayerNorm scale and bias, two kernels and biases, and x; fp8jax: six
    # parameters, x and the delayed state's leaves; without biases two fewer.
    assert checked["bf16"] == 7 and checked["gemms_only"] is None
    assert checked["fp8jax_delayed"] - checked["fp8jax_delayed_nobias"] == 2


def test_scaling_dense_rows_check_their_gradients_and_jit_bf16_as_a_user_does(monkeypatch):
    """bench/scaling.py's dense fwd+bwd rows at a toy size: dx and dw checked not zeros; the
    BF16 row jitted with XLA's defaults, the FP8 ones with fp8jax's options."""
    import harness
    import scaling

    monkeypatch.setitem(harness._heat, "seconds", 0.0)
    options = []  # of the script's own jits; the library's inside them are not recorded
    jit = jax.jit

    def recording_jit(fn, **kwargs):
        if getattr(fn, "__module__", None) == "scaling":
            options.append(kwargs.get("compiler_options"))
        return jit(fn, **kwargs)

    monkeypatch.setattr(scaling.jax, "jit", recording_jit)
    rows = scaling.dense_rows(128, 128, 256, iters=1)
    monkeypatch.setattr(scaling.jax, "jit", jit)
    assert [r["name"] for r in rows] == ["bf16", "fp8_current", "fp8_rowwise", "fp8_block"]
    assert all(r["gradient_leaves_checked"] == 2 for r in rows), rows
    assert options == [None, *[fp8jax.compiler_options()] * 3]

"""bench/attention_profile.py's reading of a Mosaic GPU profiler trace, on a made-up trace."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
import attention_profile


def _events(tid, *marks):
    """``(name, "B"|"E", ts)`` marks, ``ts`` in thousands of cycles, as the profiler writes."""
    return [{"name": n, "ph": ph, "ts": ts, "pid": 1, "tid": tid} for n, ph, ts in marks]


def test_each_region_counts_its_own_cycles_per_warpgroup_kind():
    # CTA 1: compute warpgroups (tids 1, 2) and the memory one (3); CTA 2's first
    # compute warpgroup is tid 4.
    trace = {"traceEvents": [
        *_events(1, ("wait_k", "B", 0.0), ("wait_k", "E", 1.0),
                 ("qk", "B", 1.0), ("turn_wait", "B", 1.5), ("turn_wait", "E", 2.0),
                 ("qk", "E", 3.0), ("softmax", "B", 4.0), ("softmax", "E", 6.0)),
        *_events(2, ("wait_k", "B", 0.0), ("wait_k", "E", 3.0),
                 ("softmax", "B", 3.0), ("softmax", "E", 4.0)),
        *_events(3, ("load", "B", 0.0), ("load", "E", 0.5)),
        *_events(4, ("wait_k", "B", 10.0), ("wait_k", "E", 12.0)),
    ]}  # fmt: skip
    times = attention_profile.region_times(trace)
    compute, memory = times["compute"], times["memory"]
    assert compute["ctas"] == 3 and memory["ctas"] == 1
    assert compute["span_cycles"] == pytest.approx((6000 + 4000 + 2000) / 3)
    regions = compute["regions"]
    # qk's own 1500 cycles: its 2000 less the 500 of turn_wait nested in it.
    assert regions["qk"] == pytest.approx((1500 / 3, 1 / 3))
    assert regions["turn_wait"] == pytest.approx((500 / 3, 1 / 3))
    assert regions["wait_k"] == pytest.approx(((1000 + 3000 + 2000) / 3, 1.0))
    assert regions["softmax"] == pytest.approx(((2000 + 1000) / 3, 2 / 3))
    # Only tid 1's 1000 cycles between qk's end and softmax's start are no region's.
    assert regions["(untracked)"] == pytest.approx((1000 / 3, 0.0))
    assert memory["regions"]["load"] == pytest.approx((500.0, 1.0))


def test_the_table_gives_each_kinds_cycles_a_step_beside_the_products_at_peak(capsys):
    trace = {"traceEvents": [
        *_events(1, ("wait_k", "B", 0.0), ("wait_k", "E", 1.0), ("qk", "B", 1.0), ("qk", "E", 2.0),
                 ("wait_k", "B", 2.0), ("wait_k", "E", 3.0), ("qk", "B", 3.0), ("qk", "E", 4.0)),
        *_events(3, ("load", "B", 0.0), ("load", "E", 0.5)),
    ]}  # fmt: skip
    times = attention_profile.region_times(trace)
    result = {"shape": "s", "batch": 1, "kernel": "fwd", "build": "default",
              "mma_cycles_a_step": 1024.0, "warpgroups": times}  # fmt: skip
    attention_profile.print_table(result)
    out = capsys.readouterr().out
    # Two key blocks in 4000 cycles: 2000 a step, of which wait_k and qk 1000 each.
    assert "compute warpgroups: 1, 4,000 cycles a CTA, 2.0 steps a CTA, 2,000 a step" in out
    assert "against 1,024 of products at peak" in out
    assert [line.split()[:3] for line in out.splitlines() if line.strip().startswith("wait_k")] == [
        ["wait_k", "2,000", "1,000"]
    ]


def test_a_steps_products_at_peak():
    # Forward, d 128: two warpgroups' 64 x 128 x 128 QKᵀ and PV at 8192 FP8 FLOPs a cycle.
    assert attention_profile.mma_cycles_a_step("fwd", 128) == 2 * 2 * 2 * 64 * 128 * 128 / 8192
    # dK, dV step: S (FP8) and three BF16 products of 64 x 64 x d, per warpgroup.
    product = 2 * 64 * 64 * 64
    assert attention_profile.mma_cycles_a_step("dkv", 64) == 2 * (
        product / 8192 + 3 * product / 4096
    )
    assert attention_profile.mma_cycles_a_step("dq", 64) == 2 * (
        product / 8192 + 2 * product / 4096
    )


def test_a_trace_whose_regions_do_not_nest_is_refused():
    crossed = {"traceEvents": _events(1, ("qk", "B", 0.0), ("pv", "B", 1.0), ("qk", "E", 2.0))}
    with pytest.raises(ValueError, match="'qk' ends inside 'pv'"):
        attention_profile.region_times(crossed)
    unended = {"traceEvents": _events(1, ("qk", "B", 0.0))}
    with pytest.raises(ValueError, match=r"\['qk'\] never end"):
        attention_profile.region_times(unended)


@pytest.mark.gpu
def test_a_profiled_call_on_the_gpu_times_every_region_of_each_warpgroup(tmp_path):
    from fp8jax.kernels import attention as kernel

    shape = ("causal_512", 1, 512, 4, 2, 128, True)  # bench/attention.py's tuple
    (result,) = attention_profile.profile(shape, 1, kernel.DEFAULT_CONFIG, str(tmp_path))
    assert result["kernel"] == "fwd"
    compute = result["warpgroups"]["compute"]["regions"]
    names = {"wait_k", "qk", "turn_wait", "softmax", "p_operand", "wait_v", "pv", "epilogue"}
    assert names <= set(compute), sorted(compute)
    assert all(compute[n][0] > 0 for n in ("qk", "softmax", "pv")), compute
    # Causal, 4 query tiles of 128: tile i meets i + 1 key blocks, 2.5 a CTA.
    assert compute["wait_k"][1] == pytest.approx(2.5)
    memory = result["warpgroups"]["memory"]["regions"]
    assert memory["load"][1] == pytest.approx(2.5), memory


@pytest.mark.gpu
def test_a_profiled_backward_on_the_gpu_times_both_kernels_regions(tmp_path):
    from fp8jax.kernels import attention as kernel

    shape = ("causal_512", 1, 512, 4, 2, 128, True)
    results = attention_profile.profile(shape, 1, kernel.DEFAULT_CONFIG, str(tmp_path), "bwd")
    by_kernel = {r["kernel"]: r["warpgroups"]["compute"]["regions"] for r in results}
    assert sorted(by_kernel) == ["dkv", "dq"], sorted(by_kernel)
    for name, product in (("dkv", "dv_dk"), ("dq", "dq")):
        regions = by_kernel[name]
        assert {"wait", "scores", "dp", product, "epilogue"} <= set(regions), (name, regions)
        assert all(regions[n][0] > 0 for n in ("scores", "dp", product)), (name, regions)
    # dQ's CTA i (of 4, 128 queries) steps over its 2(i + 1) key blocks of 64: 5 a CTA.
    assert by_kernel["dq"]["wait"][1] == pytest.approx(5.0)

"""The verifier lists every exchange of FP8 rows: all-to-all, ragged-all-to-all, collective-permute.

The samples (data/h100_ep_exchange8, data/h100_tp_ring8; generate.py) are
deviceless compiles for 8 H100s of expert parallelism's exchanges and
tensor parallelism's ring, each an async ``-start``/``-done`` pair in the
HLO. :func:`exchanges` is the check the sharding tests make; it must fail
where the expected collective is missing, which the last test shows.
"""

import pathlib

import pytest

from fp8jax.verify import gemm_report

DATA = pathlib.Path(__file__).parent / "data"
E4M3 = "f8e4m3fn"


def exchanges(report, kind: str, dtype: str):
    """The report's ``kind`` collectives in ``dtype``; an AssertionError if there is none."""
    rows = [c for c in report.collectives if c.kind == kind and c.dtype == dtype]
    if not rows:
        raise AssertionError(
            f"expected a {kind} in {dtype}, got {[(c.kind, c.dtype) for c in report.collectives]}"
        )
    return rows


def _report(name):
    return gemm_report((DATA / f"{name}.hlo.txt").read_text())


def test_expert_parallel_exchange_sends_fp8_rows_and_s32_counts():
    report = _report("h100_ep_exchange8")
    # Each device's 64 rows of 256 FP8 values, both ways of sending them.
    for kind in ("all-to-all", "ragged-all-to-all"):
        rows = exchanges(report, kind, E4M3)
        assert [(c.shape, c.is_async) for c in rows] == [((64, 256), True)], rows
    # The ragged exchange's bytes also count the buffer it writes into and its offsets.
    assert exchanges(report, "all-to-all", E4M3)[0].bytes == 64 * 256
    # The counts: one row of 8 per device.
    assert [c.shape for c in exchanges(report, "all-to-all", "s32")] == [(1, 8)]
    assert len(report.collectives) == 3, report.collectives


def test_tensor_parallel_ring_passes_fp8_shards():
    rows = exchanges(_report("h100_tp_ring8"), "collective-permute", E4M3)
    assert len(rows) == 7 and len(_report("h100_tp_ring8").collectives) == 7
    assert all(c.shape == (64, 256) and c.bytes == 64 * 256 and c.is_async for c in rows), rows


ABSENT = [("h100_tp_ring8", "all-to-all"), ("h100_tp_ring8", "ragged-all-to-all"),
          ("h100_ep_exchange8", "collective-permute")]  # fmt: skip


@pytest.mark.parametrize(("name", "kind"), ABSENT)
def test_the_check_fails_where_the_collective_is_absent(name, kind):
    with pytest.raises(AssertionError, match=f"expected a {kind}"):
        exchanges(_report(name), kind, E4M3)

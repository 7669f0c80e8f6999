"""The committed HLO samples are what today's library compiles to.

test_report.py and tests/bench/test_breakdown.py read the samples, not a
fresh compile; without this check a library change (such as quantizing
through the Pallas cast kernel) leaves them testing a program fp8jax no
longer produces.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

GENERATE = pathlib.Path(__file__).parent / "data" / "generate.py"


@pytest.mark.deviceless
def test_samples_of_fp8jax_programs_match_a_fresh_compile():
    # A subprocess: generate.py compiles for 8 devices and 2 hosts, which
    # needs its own JAX start-up.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, str(GENERATE), "--check"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Every sample generate.py marks as an fp8jax program was compared: the
    # FSDP ones too, which test_report.py reads for its gathers and JSON.
    compared = set(re.findall(r"^(\S+) is current$", result.stdout, re.M))
    assert compared == {
        "h100_dense_default", "h200_dense_cublas", "h100_dense_fsdp8_default",
        "h200_dense_fsdp8_2hosts_cublas", "h100_scan_cublas", "cpu_dense",
    }, result.stdout  # fmt: skip

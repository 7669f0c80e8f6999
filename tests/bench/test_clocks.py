"""bench/clocks.py: reading nvidia-smi's samples, on a machine that may have none."""

import io
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
import clocks


def test_without_nvidia_smi_there_is_no_summary(monkeypatch):
    monkeypatch.setattr(clocks.shutil, "which", lambda name: None)
    with clocks.ClockSampler() as sampler:
        pass
    assert sampler.summary() is None


def test_samples_are_parsed_and_only_non_idle_reasons_count_as_holding_the_clock_down():
    class FakeProcess:
        stdout = io.StringIO(
            "1980, 120.5, 0x0000000000000001\n"  # idle: not held down
            "1500, 690.0, 0x0000000000000004\n"  # software power cap
            "[N/A], 700.0, 0x0\n"  # unparsable: skipped
            "1740, 650.0, 0x0000000000000000\n"
        )

    sampler = clocks.ClockSampler()
    sampler._process = FakeProcess()
    sampler._read()
    summary = sampler.summary()
    assert summary["samples"] == 3
    assert summary["sm_mhz_mean"] == (1980 + 1500 + 1740) / 3
    assert summary["sm_mhz_min"] == 1500
    assert summary["power_w_mean"] == (120.5 + 690.0 + 650.0) / 3
    assert summary["clock_held_share"] == 1 / 3


def test_the_sampled_gpu_is_the_first_visible_one(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert clocks.sampled_gpu() == "0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert clocks.sampled_gpu() == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")
    assert clocks.sampled_gpu() == "3"

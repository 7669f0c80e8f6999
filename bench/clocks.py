"""The GPU's SM clock and power while a benchmark row is timed, from ``nvidia-smi``.

Under dense work the H200 reaches its 700 W cap within about a second and
lowers its SM clock from 1980 MHz to 1450-1600 MHz for BF16 GEMMs
(``clocks_event_reasons`` 0x4, software power cap), less for FP8 ones
(docs/design.md#timing-at-the-power-cap). A row timed right after
an idle spell therefore runs faster than the same program in a training
job, and a short row (an FP8 one) escapes more of the cap than a long one
(its BF16 baseline). The harness heats each row to that steady state
before timing it (``--heat``) and records what the clock did meanwhile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

_QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"


def sampled_gpu() -> str:
    """The benchmark's first GPU as nvidia-smi names it (it ignores CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


class ClockSampler:
    """Samples the first visible GPU's SM clock, power and clock-event reasons, in a thread.

    A context manager; :meth:`summary` describes the samples taken inside it,
    or is None where ``nvidia-smi`` is missing or printed nothing usable.
    """

    def __init__(self, period_ms: int = 50):
        self.period_ms = period_ms
        self.samples: list[tuple[float, float, bool]] = []
        self._process = None
        self._reader = None

    def __enter__(self):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return self
        self._process = subprocess.Popen(
            [exe, f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits",
             "-i", sampled_gpu(), "-lms", str(self.period_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self):
        for line in self._process.stdout:
            fields = [f.strip() for f in line.split(",")]
            try:
                mhz, watts, reasons = float(fields[0]), float(fields[1]), int(fields[2], 16)
            except (ValueError, IndexError):
                continue
            # Bit 0 is "GPU idle"; any other reason lowered the clock.
            self.samples.append((mhz, watts, bool(reasons & ~1)))

    def __exit__(self, *exc):
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
            self._reader.join(timeout=1)
        return False

    def summary(self) -> dict | None:
        """Mean and lowest SM MHz, mean watts, and the share of samples with the clock held down."""
        if not self.samples:
            return None
        mhz = [s[0] for s in self.samples]
        return {
            "sm_mhz_mean": sum(mhz) / len(mhz),
            "sm_mhz_min": min(mhz),
            "power_w_mean": sum(s[1] for s in self.samples) / len(self.samples),
            "clock_held_share": sum(s[2] for s in self.samples) / len(self.samples),
            "samples": len(self.samples),
        }

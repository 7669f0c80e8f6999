"""``fp8jax train --profile DIR``: a ``jax.profiler`` trace of a few whole train steps."""

from __future__ import annotations

from collections.abc import Callable

import jax

PROFILE_STEPS = 3  # steps traced, starting after the first (compile) step of a session


class StepProfiler:
    """Traces steps ``start + 2`` to ``start + 1 + PROFILE_STEPS`` (capped at ``last_step``).

    The first step of a session is mostly compile, so the trace starts after
    it; it stops once the last traced step has finished on the device, so it
    holds whole steps. Open the directory with TensorBoard's profile plugin or
    Perfetto (``*.trace.json.gz``).
    """

    def __init__(self, directory: str | None, start: int, last_step: int,
                 say: Callable[[str], None]):  # fmt: skip
        self.directory, self.say = directory, say
        self.first = start + 2
        self.last = min(self.first + PROFILE_STEPS - 1, last_step)
        self.active = False

    def before(self, step: int) -> None:
        if self.directory is not None and step == self.first:
            jax.profiler.start_trace(self.directory)
            self.active = True

    def after(self, step: int, loss: jax.Array) -> None:
        if self.active and step == self.last:
            loss.block_until_ready()
            self.stop()
            self.say(f"profile: steps {self.first}-{self.last} traced into {self.directory}")

    def stop(self) -> None:
        """Ends the trace (also when a stop cuts it short), freeing the profiler."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False

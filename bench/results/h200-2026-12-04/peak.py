"""Compile-only: the llama-3b train step's peak memory with and without the norm's dx aliased."""
import sys

import gpt
import jax

from fp8jax.ops import norm_backward

for preset, batch in (("llama-3b", 8),):
    for alias in (True, False):
        norm_backward.ALIAS_RESIDUAL = alias
        program, step, args, _, _ = gpt.step_and_args(preset, "fp8jax_current", batch_size=batch)
        with jax.numpy_dtype_promotion("standard"), program.sharding_context():
            m = step.lower(*args).compile().memory_analysis()
        peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        print(preset, batch, "alias", alias, "peak GiB", peak / 2**30, "temp", m.temp_size_in_bytes / 2**30, flush=True)
        del program, step, args
sys.exit(0)

"""Compile-only: llama-3b step peak with the padded norm kernels in the forward, the backward, both, neither."""
import sys
import gpt
import jax
from fp8jax.ops import norm_backward, norm_forward, _fused

def make_fits(pad, rows_per_program):
    def fits(shape, row_shards=1):
        rows, hidden = shape
        ok = (hidden >= 128 and norm_backward.padded_width(hidden) <= 16384) if pad else (hidden & (hidden - 1) == 0 and 128 <= hidden <= 16384)
        return ok and rows % (row_shards * rows_per_program) == 0
    return fits

_fused.RECOMPUTE = True
for name, fwd, bwd in (("pow2", 0, 0), ("fwd", 1, 0), ("bwd", 0, 1), ("pad", 1, 1)):
    norm_forward.fits = make_fits(fwd, norm_forward.ROWS_PER_PROGRAM)
    norm_backward.kernel_row_axes.__defaults__ = (make_fits(bwd, norm_backward.ROWS_PER_PROGRAM),)
    program, step, args, _, _ = gpt.step_and_args("llama-3b", "fp8jax_current", batch_size=8)
    with jax.numpy_dtype_promotion("standard"), program.sharding_context():
        c = step.lower(*args).compile()
    m = c.memory_analysis()
    hlo = c.as_text()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    print(name, "peak GiB", round(peak / 2**30, 3), "temp", round(m.temp_size_in_bytes / 2**30, 3),
          "norm_forward", hlo.count('fp8jax_norm_forward'), "norm_backward", hlo.count('fp8jax_norm_backward'), flush=True)
    with open(f"{sys.argv[1]}/{name}.hlo.txt", "w") as f:
        f.write(hlo)
    del program, step, args, c

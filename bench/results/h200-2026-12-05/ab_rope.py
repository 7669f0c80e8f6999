"""A/B in one process: RoPE's backward by autodiff (rows named *autodiff*) or as the rotation by the negative angle (the library); bf16* rows run the BF16 baseline, *delayed* rows delayed scaling, the rest current scaling."""
import json, sys
import jax
import jax.numpy as jnp
import gpt
from harness import measure, start, print_table
from fp8jax.flax import _attention, rotary

what, out = sys.argv[1], sys.argv[2]
order = sys.argv[3].split(",")
trace = sys.argv[4] if len(sys.argv) > 4 else None


def autodiff_rotary(x, positions, *, base=10000.0):
    batch, seq, _, dim = x.shape
    half = dim // 2
    inv_freq = jnp.power(jnp.float32(base), -jnp.arange(half, dtype=jnp.float32) / jnp.float32(half))
    pos = jnp.broadcast_to(positions, (batch, seq)).astype(jnp.float32)
    angle = pos.reshape(batch, seq, 1, 1) * inv_freq.reshape(1, 1, 1, half)
    return rotary._rotate(x, jnp.sin(angle), jnp.cos(angle))


class A: heat = 1.0; compile_cache = None
env = start(A)
print(env, flush=True)
preset, batch = what.split(":")
rows = []
traced = set()
for name in order:
    _attention.apply_rotary = autodiff_rotary if "autodiff" in name else rotary.apply_rotary
    variant = "bf16" if name.startswith("bf16") else ("fp8jax_delayed" if "delayed" in name else "fp8jax_current")
    program, step, args, tokens, devices = gpt.step_and_args(preset, variant, batch_size=int(batch))
    tdir = None
    if trace and name not in traced and not name.startswith("bf16") and "autodiff" not in name:
        tdir = trace
        traced.add(name)
    with jax.numpy_dtype_promotion("standard"), program.sharding_context():
        row = measure(name, step, *args, iters=3, devices=devices, carry=True, trace_dir=tdir)
    gpt.row_rates(row, program, tokens, devices)
    print(f"    {row['tokens_per_s']:,.0f} tokens/s", flush=True)
    del program, step, args
    rows.append(row)
    json.dump({"environment": env, "what": what, "rows": rows}, open(out, "w"), indent=1, default=str)
print_table(f"{what}: RoPE backward by autodiff / as the rotation back", rows, "bf16")

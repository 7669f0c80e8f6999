"""A/B in one process: the train step with the amax rows and padded norm kernels (new) or without (old)."""
import json, os, sys
import jax
import gpt
from harness import measure, start, print_table
import fp8jax.quantize as quantize
from fp8jax.ops import norm_backward

preset, batch, iters, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
order = sys.argv[5].split(",")
new_fits = norm_backward.hidden_fits
def old_fits(hidden):  # the tree before: powers of two only
    return hidden & (hidden - 1) == 0 and norm_backward.MIN_HIDDEN <= hidden <= norm_backward.MAX_HIDDEN
class A: heat = 1.0; compile_cache = None
env = start(A)
print(env, flush=True)
rows = []
for name in order:
    variant = "bf16" if name == "bf16" else "fp8jax_current"
    new = name.startswith("new")
    quantize._MIN_ROW = 1024 if new else 1
    norm_backward.hidden_fits = new_fits if new else old_fits
    program, step, args, tokens, devices = gpt.step_and_args(preset, variant, batch_size=batch)
    trace = os.path.join("/tmp/trace_" + preset) if name in ("old", "new") else None
    with jax.numpy_dtype_promotion("standard"), program.sharding_context():
        row = measure(name, step, *args, iters=iters, trace_dir=trace, devices=devices, carry=True)
    gpt.row_rates(row, program, tokens, devices)
    print(f"    {row['tokens_per_s']:,.0f} tokens/s, {row['mfu_text']}", flush=True)
    rows.append(row)
    del program, step, args
    json.dump({"environment": env, "preset": preset, "batch": batch, "rows": rows}, open(out, "w"), indent=1, default=str)
print_table(f"{preset} x {batch}: old tree (before) against new", rows, "bf16")

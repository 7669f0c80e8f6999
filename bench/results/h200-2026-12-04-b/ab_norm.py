"""A/B in one process: norm kernels for powers of two only (pow2) or padded (pad); FP8 output kept (keep) or cast again in the backward (again)."""
import json, sys
import jax
import gpt, layer
from harness import measure, start, print_table, output_cotangent
import fp8jax
from fp8jax.ops import norm_backward, _fused

what, out = sys.argv[1], sys.argv[2]
order = sys.argv[3].split(",")
pad_fits = norm_backward.hidden_fits
def pow2_fits(hidden):
    return hidden & (hidden - 1) == 0 and norm_backward.MIN_HIDDEN <= hidden <= norm_backward.MAX_HIDDEN
class A: heat = 1.0; compile_cache = None
env = start(A)
print(env, flush=True)
saved_output = _fused.saved_output
def keep(normed, norm):
    return normed.fp8
rows = []
for name in order:
    norm_backward.hidden_fits = pad_fits if "pad" in name else pow2_fits
    _fused.saved_output = saved_output if "again" in name else keep
    if what.startswith("llama"):
        preset, batch = what.split(":")
        variant = "bf16" if name == "bf16" else ("fp8jax_delayed" if "delayed" in name else "fp8jax_current")
        program, step, args, tokens, devices = gpt.step_and_args(preset, variant, batch_size=int(batch))
        with jax.numpy_dtype_promotion("standard"), program.sharding_context():
            row = measure(name, step, *args, iters=3, devices=devices, carry=True)
        gpt.row_rates(row, program, tokens, devices)
        print(f"    {row['tokens_per_s']:,.0f} tokens/s", flush=True)
        del program, step, args
    else:  # the TE layer
        import dataclasses
        shape = layer.PRESETS["te"]
        x = jax.random.normal(jax.random.key(1), (shape.batch, shape.seq, shape.hidden)).astype(layer.BF16)
        variant = "bf16" if name == "bf16" else ("fp8jax_delayed" if "delayed" in name else "fp8jax_current")
        fn, fn_args = layer.VARIANTS[variant](x, shape, "cudnn")
        row = measure(name, fn, *fn_args, iters=20, state_arg=2 if variant.startswith("fp8jax") else None)
    rows.append(row)
    json.dump({"environment": env, "what": what, "rows": rows}, open(out, "w"), indent=1, default=str)
print_table(f"{what}: norm kernels pow2/pad, FP8 output keep/again", rows, "bf16")

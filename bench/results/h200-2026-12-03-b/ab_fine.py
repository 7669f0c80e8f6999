"""A/B in one process: an earlier commit's library (fp8jax_old) against the working tree, TE and
Llama layers, under any of current, delayed, row (RowwiseScaling) and block (BlockScaling),
alternating, delayed state calibrated. (h200-2026-12-02-e/ab_tree.py with the recipes added.)

The old tree is that commit's src/fp8jax renamed, in .probe/old/fp8jax_old:
  git archive OLD src/fp8jax | tar -x -C .probe/old; mv .probe/old/src/fp8jax .probe/old/fp8jax_old
then its imports rewritten to fp8jax_old (`import fp8jax_old as fp8jax` where a module imports the
package whole) and its JAX config option renamed (kernels/dispatch.py: "fp8jax_old_pallas").
Usage: python -u ab_fine.py RECIPES PRESETS, e.g. `row,block te,llama3-8b`.
"""
import sys
sys.path.insert(0, ".probe/old"); sys.path.insert(0, "bench")
import jax, jax.numpy as jnp
import fp8jax, fp8jax_old
import fp8jax.flax.linen as new_linen
import fp8jax_old.flax.linen as old_linen
import layer
from harness import measure, print_table, output_loss, output_cotangent, bf16_matrices

BF16 = jnp.bfloat16
recipes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["current"]
presets = sys.argv[2].split(",") if len(sys.argv) > 2 else ["te", "llama3-8b"]

def layer_variant(lib, linen, recipe, x, s):
    m = linen.TransformerLayer(num_heads=s.heads, num_kv_heads=s.kv_heads, intermediate_dim=s.ffn,
        activations=("silu", "linear") if s.gated else ("gelu_tanh",),
        norm_type="rmsnorm" if s.gated else "layernorm", use_bias=not s.gated, causal=True,
        attention_implementation="cudnn", dtype=BF16, recipe=recipe)
    v = bf16_matrices(jax.jit(m.init)(jax.random.key(0), x))
    def loss(params, x, state, r):
        c = {"params": params} if state is None else {"params": params, "fp8_state": state}
        return output_loss(m.apply(c, x), r)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), compiler_options=lib.compiler_options())
    return step, (v["params"], x, v.get("fp8_state"), output_cotangent(x.shape))

def calibrated(lib, fn, a):
    a = list(a)
    if a[2] is None:
        return a
    for _ in range(3):
        _, grads = fn(*a)
        a[2] = jax.block_until_ready(lib.take_new_state(a[2], grads[2]))
    return a

libs = {"old": (fp8jax_old, old_linen), "new": (fp8jax, new_linen)}
for preset in presets:
    s = layer.PRESETS[preset]
    x = jax.random.normal(jax.random.key(1), (s.batch, s.seq, s.hidden)).astype(BF16)
    rows = []
    for rnd in range(2):
        for tag in ("old", "new") if rnd == 0 else ("new", "old"):
            lib, linen = libs[tag]
            for rname in recipes:
                recipe = {"current": lib.CurrentScaling, "row": lib.RowwiseScaling, "block": lib.BlockScaling}[rname]() if rname != "delayed" else lib.DelayedScaling(amax_history_len=1024)
                fn, a = layer_variant(lib, linen, recipe, x, s)
                rows.append(measure(f"{preset}_{rname}_{tag}_{rnd}", fn, *calibrated(lib, fn, a), iters=10))
    print_table(f"A/B HEAD vs tree, {preset}", rows, rows[0]["name"])

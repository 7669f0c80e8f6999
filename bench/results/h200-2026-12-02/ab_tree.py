"""Issue 30's A/B in one process: the layer and the GeGLU MLP on the old tree (e801ae1, renamed
fp8jax_old) against the new one, alternating, each row's delayed state calibrated."""
import functools, sys
sys.path.insert(0, "old")
import jax, jax.numpy as jnp
import fp8jax, fp8jax_old
import fp8jax.flax.linen as new_linen
import fp8jax_old.flax.linen as old_linen
import layer
from harness import measure, print_table, output_loss, output_cotangent, bf16_matrices, calibrate_state

BF16 = jnp.bfloat16

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

def mlp_variant(lib, recipe, x, ffn=16384):
    hidden = x.shape[-1]
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"g": jnp.ones((hidden,), jnp.float32), "b": jnp.zeros((hidden,), jnp.float32),
         "k1": (jax.random.normal(k1, (hidden, 2, ffn)) * 0.02).astype(BF16),
         "k2": (jax.random.normal(k2, (ffn, hidden)) * 0.02).astype(BF16)}
    state = lib.init_state(recipe, lib.MlpScaleState)
    def loss(p, x, state, r):
        y = lib.layernorm_mlp(x, p["g"], p["b"], p["k1"], p["k2"], activations=("gelu", "linear"), recipe=recipe, state=state)
        return output_loss(y, r)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), compiler_options=lib.compiler_options())
    return step, (p, x, state, output_cotangent(x.shape))

def calibrated(lib, fn, a):
    """The step's args with its delayed state calibrated by ``lib``'s own take_new_state."""
    a = list(a)
    if a[2] is None:
        return a
    for _ in range(3):
        _, grads = fn(*a)
        a[2] = jax.block_until_ready(lib.take_new_state(a[2], grads[2]))
    return a

libs = {"old": (fp8jax_old, old_linen), "new": (fp8jax, new_linen)}
s = layer.PRESETS["te"]
x = jax.random.normal(jax.random.key(1), (s.batch, s.seq, s.hidden)).astype(BF16)
rows = []
for rnd in range(2):
    for tag in ("old", "new") if rnd == 0 else ("new", "old"):
        lib, linen = libs[tag]
        for rname, recipe in (("current", lib.CurrentScaling()), ("delayed", lib.DelayedScaling(amax_history_len=1024))):
            fn, a = layer_variant(lib, linen, recipe, x, s)
            rows.append(measure(f"layer_{rname}_{tag}_{rnd}", fn, *calibrated(lib, fn, a), iters=20))
print_table("A/B old tree vs new, TE layer", rows, rows[0]["name"])
xm = jax.random.normal(jax.random.key(1), (16384, 4096)).astype(BF16)
rows = []
for rnd in range(2):
    for tag in ("old", "new") if rnd == 0 else ("new", "old"):
        lib, _ = libs[tag]
        fn, a = mlp_variant(lib, lib.DelayedScaling(amax_history_len=1024), xm)
        rows.append(measure(f"geglu_delayed_{tag}_{rnd}", fn, *calibrated(lib, fn, a), iters=20))
print_table("A/B old tree vs new, GeGLU MLP delayed", rows, rows[0]["name"])

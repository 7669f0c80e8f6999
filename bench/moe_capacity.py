"""The expert-parallel MoE train step's receive buffer and peak memory, dropless against a capacity.

Compiles the train step (forward and backward) of one ``MoEBlock`` under
``ShardingConfig(ep=...)`` on 8 devices, once dropless and once per capacity
factor, and prints for each the receive buffer's rows (the largest
``ragged_all_to_all`` output in the jaxpr), that as a multiple of the
balanced share (``tokens * top_k / ep`` rows per device) and the compiled
step's per-device peak (``memory_analysis()``: arguments, outputs and
temporaries). Nothing runs: the numbers are the compiler's.

On a CPU host it fakes 8 devices (the exchange is then the all_to_all
emulation, which sends ``ep`` times the receive buffer, so the CPU peak
exaggerates what the buffer costs); on a host with 8 GPUs it compiles for
them:

    PYTHONPATH=src python bench/moe_capacity.py
    PYTHONPATH=src python bench/moe_capacity.py --experts 64 --top-k 6 --hidden 2048 \
        --ffn 1408 --tokens 65536 --capacity 1.0 1.25 2.0
"""

from __future__ import annotations

import argparse
import os
import re

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import flax.linen as nn
import jax
import jax.numpy as jnp

import fp8jax.sharding as fs
from fp8jax.flax import linen as fnn

EP = fs.ShardingConfig(ep="ep")


def measure(args, capacity_factor):
    """``(receive rows, peak bytes per device)`` of the ep=8 train step."""
    mesh = fs.make_mesh(ep=8, config=EP)
    block = fnn.MoEBlock(num_experts=args.experts, top_k=args.top_k, ffn=args.ffn,
                         dtype=jnp.bfloat16, capacity_factor=capacity_factor)  # fmt: skip
    x = jax.ShapeDtypeStruct((8, args.tokens // 8, args.hidden), jnp.bfloat16)
    abstract = jax.eval_shape(block.init, jax.random.key(0), x)
    shardings = nn.meta.unbox(fs.variable_shardings(abstract, mesh, EP))
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nn.meta.unbox(abstract), shardings)["params"]  # fmt: skip
    x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=fs.named_sharding(mesh, ("batch",), EP))

    def step(params, x):
        def loss(params, x):
            y, _ = block.apply({"params": params}, x, mutable=["intermediates"])
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    with fs.use_mesh(mesh, EP):
        jaxpr = str(jax.make_jaxpr(step)(params, x))
        compiled = jax.jit(step).lower(params, x).compile()
    shapes = re.findall(rf"\[(\d+),{args.hidden}\] = ragged_all_to_all", jaxpr)
    memory = compiled.memory_analysis()
    peak = sum(getattr(memory, f"{k}_size_in_bytes", 0) for k in ("argument", "output", "temp"))
    return max(int(r) for r in shapes), peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16384, help="all devices' tokens")
    parser.add_argument("--capacity", type=float, nargs="+", default=[1.25])
    args = parser.parse_args()
    balanced = args.tokens * args.top_k // 8
    print(f"{jax.device_count()} {jax.devices()[0].platform} devices, ep=8, "
          f"{args.experts} experts, top-{args.top_k}, {args.tokens} tokens; "
          f"balanced share {balanced} rows per device", flush=True)  # fmt: skip
    base_rows, base_peak = measure(args, None)
    print(
        f"{'capacity':>10} {'recv rows':>10} {'x balanced':>10} {'peak GiB':>9} {'x dropless':>10}"
    )
    print(f"{'dropless':>10} {base_rows:>10} {base_rows / balanced:>10.2f} "
          f"{base_peak / 2**30:>9.3f} {1:>10.2f}", flush=True)  # fmt: skip
    for factor in args.capacity:
        rows, peak = measure(args, factor)
        print(f"{factor:>10} {rows:>10} {rows / balanced:>10.2f} {peak / 2**30:>9.3f} "
              f"{peak / base_peak:>10.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

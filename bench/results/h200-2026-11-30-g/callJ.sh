#!/bin/bash
# J7: the MLP rows at 3e8d38b (the library's MLP path is a63840b's; 6D measured it). GPU 0: GeGLU, SwiGLU,
# gelu against BF16 and Flax direct (as 6D); GPU 1: GeGLU and SwiGLU with current scaling and Flax QDQ too.
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout 420 python3 mlp.py --activations gelu,linear silu,linear gelu --iters 20 \
    --variants bf16 flax_fp8_direct fp8jax_delayed --out $OUT/J_mlp.json 2>&1 | flt | ts > $OUT/J_mlp.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout 420 python3 mlp.py --activations gelu,linear silu,linear --iters 20 \
    --variants bf16 fp8jax_delayed fp8jax_current flax_fp8_qdq --out $OUT/J_mlp_all.json 2>&1 | flt | ts > $OUT/J_mlp_all.log ) &
wait
tar czf $OUT/atc.tgz -C $R/.dev atc
for f in $OUT/J_mlp.log $OUT/J_mlp_all.log; do echo "=== $f"; grep -v "Traceback\|File \"" $f | grep "x  \|rror\|fwd+bwd" | cut -c1-170 | tail -20; done

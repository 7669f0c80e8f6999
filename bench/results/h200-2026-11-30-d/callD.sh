#!/bin/bash
# D (session 2026-11-30 d), HEAD fc95d17: traced rows for the kernel breakdown and quantize share,
# fp8jax delayed next to BF16: GPU 0 --loss mean, GPU 1 --loss square; MLP (GeGLU, SwiGLU), layer.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-300} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p $OUT/logs $OUT/tr
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
cd bench
run() {  # gpu loss
  CUDA_VISIBLE_DEVICES=$1 XLA_FLAGS="$AT" timeout $(left) python3 mlp.py --loss $2 --activations gelu,linear silu,linear --iters 20 --variants bf16 fp8jax_delayed --trace $OUT/tr/m$2 --out $OUT/D_mlp_$2.json 2>&1 | flt > $OUT/logs/D_mlp_$2.log
  CUDA_VISIBLE_DEVICES=$1 XLA_FLAGS="$AT" timeout $(left) python3 layer.py --loss $2 --iters 20 --variants bf16 fp8jax_delayed --trace $OUT/tr/l$2 --out $OUT/D_layer_$2.json 2>&1 | flt > $OUT/logs/D_layer_$2.log
}
run 0 mean & run 1 square &
wait
rm -rf $OUT/tr
for f in $OUT/logs/*.log; do echo "=== $f"; grep -v "Traceback\|File \"" $f | grep "x  \|rror" | cut -c1-150 | tail -8; done
rm -rf $OUT/logs

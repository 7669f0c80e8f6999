#!/bin/bash
# 9F: HEAD's rows for the docs and the GPU tests. Both GPUs: the live GPU tests. Then GPU 0: layer.py
# (mean, traced; square), GPU 1: mlp.py SwiGLU, GeGLU, gelu (traced).
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-575} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | flt > $OUT/F_pytest_gpu.log
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 layer.py --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --trace /tmp/fl \
    --out $OUT/F_layer.json 2>&1 | flt | ts > $OUT/F_layer.log
  CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 layer.py --loss square --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed \
    --out $OUT/F_layer_square.json 2>&1 | flt | ts > $OUT/F_layer_square.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 mlp.py --activations silu,linear gelu,linear gelu --iters 20 \
    --variants bf16 flax_fp8_direct fp8jax_delayed --trace /tmp/fm --out $OUT/F_mlp.json 2>&1 | flt | ts > $OUT/F_mlp.log ) &
wait
tail -n 3 $OUT/F_pytest_gpu.log
for f in $OUT/F_layer.log $OUT/F_layer_square.log $OUT/F_mlp.log; do echo "=== $f"; grep -v "Traceback\|File \"" $f | grep "x  \|x (\|rror" | cut -c1-170 | tail -14; done

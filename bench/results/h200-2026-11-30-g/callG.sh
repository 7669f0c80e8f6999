#!/bin/bash
# G7: does the order of rows in one layer.py process move the ratio? GPU 0: bf16, delayed, bf16, delayed;
# GPU 1: delayed, bf16, delayed, bf16 (mean loss, 95aaba3).
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout 300 python3 layer.py --iters 20 --variants bf16 fp8jax_delayed bf16 fp8jax_delayed --out $OUT/G_order_gpu0.json 2>&1 | flt > $OUT/G_order_gpu0.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout 300 python3 layer.py --iters 20 --variants fp8jax_delayed bf16 fp8jax_delayed bf16 --out $OUT/G_order_gpu1.json 2>&1 | flt > $OUT/G_order_gpu1.log ) &
wait
for f in $OUT/G_order_gpu0.log $OUT/G_order_gpu1.log; do echo "=== $f"; grep " ms (" $f | cut -c1-150; done

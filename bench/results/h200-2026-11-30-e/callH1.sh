#!/bin/bash
# H1 (session 2026-11-30 e): standalone variants of GeGLU's pre-activation gradient (bwdbench.py).
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
cd bench
mkdir -p $OUT/tr0 $OUT/tr1
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout 300 python3 $R/.dev/bwdbench.py $OUT/tr0 old fused_complex complex_only f32sum_only 2>&1 | flt > $OUT/H1_gpu0.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout 300 python3 $R/.dev/bwdbench.py $OUT/tr1 complex_plain f32_plain cast_amax_then_sum 2>&1 | flt > $OUT/H1_gpu1.log ) &
wait
rm -rf $OUT/tr0 $OUT/tr1
cat $OUT/H1_gpu0.log $OUT/H1_gpu1.log | grep -v "GPU idle" | cut -c1-200

#!/bin/bash
# J (session 2026-11-30 e): Pallas (Triton) prototypes, .dev/pallas_ct.py. GPU 0: FP8 cast + transpose +
# column sums of a bf16 gradient against XLA's cast kernel + FP8 transpose. GPU 1: GeGLU's whole
# pre-activation gradient (math, FP8 cast, transposed copy, bias sums, amax) in one kernel, against
# fp8jax's current XLA path; each followed by the wgrad GEMM that reads the transposed copy.
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench:$R/.dev
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
mkdir -p $OUT/tr0 $OUT/tr1
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout 280 python3 .dev/pallas_ct.py ct $OUT/tr0 2>&1 | flt > $OUT/J_ct.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout 280 python3 .dev/pallas_ct.py geglu $OUT/tr1 2>&1 | flt > $OUT/J_geglu.log ) &
wait
rm -rf $OUT/tr0 $OUT/tr1
cat $OUT/J_ct.log $OUT/J_geglu.log | grep -v "GPU idle\|^  File\|^    " | cut -c1-220 | tail -60
grep -h "      " $OUT/J_ct.log $OUT/J_geglu.log | cut -c1-200 | head -60

#!/bin/bash
# E (session 2026-11-30 d): layer, --loss square, fc95d17 + EXP_K1=1 (kernel_1's FP8 copy for the dgrad
# quantized from the bf16 kernel in its own layout, instead of XLA transposing the forward's FP8 copy back).
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-200} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p $OUT/tr
export PYTHONPATH=$R/src:$R/bench
cd bench
CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss square --no-bf16 --exps "" "EXP_K1=1" "" "EXP_K1=1" --trace $OUT/tr --out $OUT/E_layer_k1.json 2>&1 | grep --line-buffered -v "^W0000\|^I0000\|^E0000" > $OUT/E_layer_k1.log
rm -rf $OUT/tr
grep "compile\|ms:\|fp8jax_delayed\|rror" $OUT/E_layer_k1.log | cut -c1-170 | tail -20

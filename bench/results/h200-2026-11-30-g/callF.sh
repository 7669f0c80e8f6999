#!/bin/bash
# F7: the QKV forward as one FP8 GEMM per piece, each GEMM's scale tied to its own operand
# (EXP_FWD3=1), against 05157de (one GEMM, then slices). Layer, mean loss, alternating, GPU 0;
# the same with --loss square on GPU 1.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-400} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
mkdir -p /tmp/tr0 /tmp/tr1
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_FWD3=1" "" "EXP_FWD3=1" "" "EXP_FWD3=1" --trace /tmp/tr0 --out $OUT/F_layer_ab.json 2>&1 | flt > $OUT/F_layer_ab.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss square --exps "" "EXP_FWD3=1" "" "EXP_FWD3=1" --out $OUT/F_layer_ab_square.json 2>&1 | flt > $OUT/F_layer_ab_square.log ) &
wait
for f in $OUT/F_layer_ab.log $OUT/F_layer_ab_square.log; do echo "=== $f"; grep "x (\|rror" $f | cut -c1-170; done

#!/bin/bash
# A (session 2026-11-30 d): layer and GeGLU MLP, --loss square, one process per GPU:
# EXP_OLDBIAS=1 (bias outside the custom_vjp, row-max gradient amax: the committed HEAD's behaviour)
# against the bias inside (quantize_gradient: column amax + bias sum + FP8 in one pass), and EXP_HQ=1
# (the forward activation quantized straight to FP8, its amax recomputed from pre).
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-540} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p $OUT/logs $OUT/tr
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
cd bench
EXPS=("EXP_OLDBIAS=1" "" "EXP_HQ=1" "EXP_OLDBIAS=1" "" "EXP_HQ=1")
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss square --exps "${EXPS[@]}" --trace $OUT/tr/layer --out $OUT/A_layer.json 2>&1 | flt | ts > $OUT/logs/A_layer.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts gelu,linear --loss square --exps "${EXPS[@]}" --trace $OUT/tr/geglu --out $OUT/A_geglu.json 2>&1 | flt | ts > $OUT/logs/A_geglu.log ) &
wait
tar czf $OUT/logs.tar.gz -C $OUT logs
tar czf $OUT/atc.tar.gz -C $R/.dev atc
rm -rf $OUT/tr
for f in $OUT/logs/*.log; do echo "=== $f"; grep -v "Traceback\|File \"" $f | grep "compile\|ms:\|x (\|rror" | cut -c1-170 | tail -24; done
rm -rf $OUT/logs

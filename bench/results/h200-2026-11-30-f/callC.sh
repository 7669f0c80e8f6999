#!/bin/bash
# C (session 2026-11-30 f): dense's own input cast with its transposed copy ("") against call B's
# base (EXP_NOLHS=1), alternating, layer, --loss mean, on GPU 0. GPU 1: the layer's rows with
# --loss square, then the GPT medium step. Brings the autotune cache back.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-540} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
mkdir -p /tmp/tr0 /tmp/tr1
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_NOLHS=1" "" "EXP_NOLHS=1" --trace /tmp/tr0 --out $OUT/C_layer_ab.json 2>&1 | flt > $OUT/C_layer_ab.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 layer.py --loss square --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed \
    --out $OUT/C_layer_square.json 2>&1 | flt | ts > $OUT/C_layer_square.log
  CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 gpt.py --config medium --donate --variants bf16 fp8jax_delayed \
    --out $OUT/C_gpt_medium.json 2>&1 | flt | ts > $OUT/C_gpt_medium.log ) &
wait
tar czf $OUT/atc.tar.gz -C $R/.dev atc
echo "=== ab"; grep "x (\|rror" $OUT/C_layer_ab.log | cut -c1-170
grep -A12 "^\[base\]" $OUT/C_layer_ab.log | head -15
for f in $OUT/C_layer_square.log $OUT/C_gpt_medium.log; do echo "=== $f"; grep -v "Traceback\|File \"" $f | grep "x  \|x (\|rror\|tokens/s" | cut -c1-170 | tail -8; done

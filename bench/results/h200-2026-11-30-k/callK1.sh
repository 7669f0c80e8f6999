#!/bin/bash
# K1: layer A/B of EXP_SPLIT (QKV forward as three GEMMs) and EXP_STATE=v2 (history update
# without roll+DUS); host gaps of fp8jax and BF16; GPT medium A/B.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-575} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(( $(left) - 25 )) python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_SPLIT=1" "EXP_STATE=v2" "EXP_SPLIT=1 EXP_STATE=v2" "" "EXP_SPLIT=1 EXP_STATE=v2" --trace /tmp/tr0 --out $OUT/K1_layer_ab.json 2>&1 | flt | ts > $OUT/K1_layer_ab.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout 200 python3 $R/.dev/hostgap.py --variants fp8jax_delayed bf16 --out /tmp/hg0 2>&1 | flt | ts > $OUT/K1_hostgap.log
  EXP_SPLIT=1 EXP_STATE=v2 CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout 100 python3 $R/.dev/hostgap.py --variants fp8jax_delayed --out /tmp/hg1 2>&1 | flt | ts >> $OUT/K1_hostgap.log
  CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(( $(left) - 25 )) python3 $R/.dev/gpt_ab.py --config medium --mesh "" --no-bf16 --exps "" "EXP_SPLIT=1 EXP_STATE=v2" --rounds 1 --out $OUT/K1_gpt1_ab.json 2>&1 | flt | ts > $OUT/K1_gpt1_ab.log ) &
wait
cd $R
tar czf $OUT/atc.tgz .dev/atc
for f in $OUT/K1_layer_ab.log $OUT/K1_hostgap.log $OUT/K1_gpt1_ab.log; do echo "=== $f"; grep "x (\|x  \|rror\|median\|step 2\|compile" $f | cut -c1-220 | tail -24; done

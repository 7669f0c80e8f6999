#!/bin/bash
# L6: the GPT medium step, BF16 and fp8jax delayed, heated, with the state donated as fp8jax train does.
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd bench
XLA_FLAGS="$AT" timeout 480 python3 gpt.py --config medium --donate --variants bf16 fp8jax_delayed --out $OUT/L6_gpt_medium.json 2>&1 | flt | ts > $OUT/L6_gpt_medium.log
cd $R
grep "x  \|rror\|SM \|tokens" $OUT/L6_gpt_medium.log | cut -c1-250 | tail -12

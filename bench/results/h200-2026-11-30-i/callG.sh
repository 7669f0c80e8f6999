#!/bin/bash
# 9G: small GPT training with the activation kernels (fp8 delayed; convergence check against 7C),
# then GPT medium fsdp=2 A/B (kernels vs EXP_NOACT=1) on both GPUs.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-570} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout 150 python3 -m fp8jax.cli train --config small --no-progress --out /tmp/runs/small-fp8-delayed --precision fp8 --recipe delayed 2>&1 | flt > $OUT/G_small-fp8-delayed.log
cp /tmp/runs/small-fp8-delayed/summary.json $OUT/G_small-fp8-delayed.summary.json 2>/dev/null
cp /tmp/runs/small-fp8-delayed/metrics.jsonl $OUT/G_small-fp8-delayed.metrics.jsonl 2>/dev/null
XLA_FLAGS="$AT" timeout $(left) python3 .dev/gpt_ab.py --config medium --mesh fsdp=2 --exps "" "EXP_NOACT=1" --rounds 2 \
    --out $OUT/G_gpt_fsdp2_ab.json 2>&1 | flt | ts > $OUT/G_gpt_fsdp2_ab.log
tail -n 6 $OUT/G_small-fp8-delayed.log
grep -v "Traceback\|File \"" $OUT/G_gpt_fsdp2_ab.log | grep "x (\|rror\|tok" | cut -c1-180 | tail -8

#!/bin/bash
# C7 (session 2026-11-30 g): the convergence runs of docs/train.md (small, 2000 steps) again, on 6610903,
# where the cast-transpose kernel serves every FP8 operand of the single-GPU train step.
# GPU 0: bf16, then fp8 delayed; GPU 1: fp8 current (--verify-target live), then bf16 seed 1.
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
run() { local gpu=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu XLA_FLAGS="$AT" timeout 280 python3 -m fp8jax.cli train --config small --no-progress --out /tmp/runs/$name "$@" 2>&1 | flt > $OUT/C_$name.log
  mkdir -p $OUT/C_runs/$name; cp /tmp/runs/$name/*.json /tmp/runs/$name/*.jsonl $OUT/C_runs/$name/ 2>/dev/null; }
( run 0 small-bf16 --precision bf16; run 0 small-fp8-delayed --precision fp8 --recipe delayed ) &
( run 1 small-fp8-current --precision fp8 --recipe current --verify-target live; run 1 small-bf16-seed1 --precision bf16 --seed 1 ) &
wait
for f in $OUT/C_runs/*/summary.json; do echo "$f"; python3 -c "import json,sys; d=json.load(open('$f')); print({k: d.get(k) for k in ('status','final_train_loss','final_val_loss','train_s','compile_s','fp8_gemms')})"; done

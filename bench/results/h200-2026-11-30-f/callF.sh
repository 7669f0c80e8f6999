#!/bin/bash
# F (session 2026-11-30 f): fp8jax train --config tiny on one GPU at 9bfd420 (the cast-transpose kernel for every
# operand is active in a one-GPU process), with the live FP8 check of the train step.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
XLA_FLAGS="--xla_gpu_per_fusion_autotune_cache_dir=$PWD/.dev/atc" timeout 200 python3 -m fp8jax.cli train --config tiny --steps 300 \
  --out /tmp/runs/tiny-fp8 --no-progress --verify-target live > $OUT/F_train_tiny.log 2>&1
echo "exit $?" >> $OUT/F_train_tiny.log
grep -v "^W0000\|^I0000" $OUT/F_train_tiny.log | tail -n 12

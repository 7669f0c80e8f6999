#!/bin/bash
# Call A: the convergence protocol on `small` (2000 steps; bf16 and the four FP8 recipes, seeds
# 0-2; five streams share the GPU, so tokens/s here says nothing about speed), and, beside it,
# the GPU tests of the kernels (FP8JAX_TEST_GPU=1 -m gpu) and the grouped-GEMM kernel check.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src XLA_PYTHON_CLIENT_MEM_FRACTION=0.12
R=/tmp/runs; mkdir -p $R/logs
stream() { local name=$1; shift
  for seed in 0 1 2; do
    timeout 170 python3 -m fp8jax.cli train --config small --no-progress --seed $seed \
      --checkpoint-every 2000 --out $R/$name-seed$seed "$@" > $R/logs/$name-seed$seed.log 2>&1
  done; }
stream bf16 --precision bf16 &
stream fp8-current --precision fp8 --recipe current &
stream fp8-delayed --precision fp8 --recipe delayed &
stream fp8-row --precision fp8 --recipe row &
stream fp8-block --precision fp8 --recipe block &
( FP8JAX_TEST_GPU=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout 300 python3 -m pytest -q -m gpu \
    tests/ops/test_ragged_dot.py tests/ops/test_fine_scaling.py -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout 200 python3 -u bench/results/h200-2026-12-02/moe_kernel_check.py \
    > $OUT/moe_kernel_check.log 2>&1 ) &
wait
cd $R && tar czf $OUT/convergence.tgz --exclude='checkpoints' --exclude='*ckpt*' */config.json */summary.json */metrics.jsonl logs
for f in $R/*/summary.json; do python3 -c "import json; d=json.load(open('$f')); print('$f'.split('/')[-2], d.get('status'), d.get('final_val_loss'), d.get('train_s'))"; done

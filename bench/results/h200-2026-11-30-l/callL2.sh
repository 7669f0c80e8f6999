#!/bin/bash
# L2: the norm forward kernel's shape (rows a program, rows a step, warps) against XLA's path at
# (16384, 4096); the live tests that failed in L1 (reductions one axis at a time now).
export PYTHONUNBUFFERED=1
R=$PWD
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
PYTHONPATH=$R/src XLA_FLAGS="$AT" timeout 300 python3 .dev/lnfwd.py 64,1,4 16,1,4 8,1,4 4,1,4 1,1,4 16,2,4 16,4,4 8,4,4 4,4,4 16,4,8 32,4,8 64,4,8 8,8,8 16,8,8 64,8,8 16,16,16 8,2,4 2,2,4 16,1,8 2>&1 | flt > $OUT/L2_lnfwd.log
PYTHONPATH=$R/src XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops 2>&1 | flt > $OUT/L2_pytest_gpu.log
tail -n 3 $OUT/L2_pytest_gpu.log; grep "^FAILED" $OUT/L2_pytest_gpu.log
cat $OUT/L2_lnfwd.log | cut -c1-220

#!/bin/bash
# E (session 2026-11-30 f): call D's two-GPU live sharding tests again, alone (in D they ran next
# to a one-GPU pytest process on GPU 0 and aborted mid-step).
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 220 python3 -m pytest -m gpu -q -p no:cacheprovider tests/sharding/test_live_gpus.py 2>&1 | flt > $OUT/E_pytest_gpu2.log
tail -n 3 $OUT/E_pytest_gpu2.log

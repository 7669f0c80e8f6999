#!/bin/bash
# 10A: the GPU tests at HEAD (both GPUs); then where the synchronized call's non-kernel time goes
# (host events) per variant, GPU 0 default flags, GPU 1 command buffers off.
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 220 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | flt > $OUT/A_pytest_gpu.log
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout 300 python3 .dev/hostgap.py --micro 1 40 160 --out /tmp/hg0 2>&1 | flt > $OUT/A_hostgap.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT --xla_gpu_enable_command_buffer=" timeout 300 python3 .dev/hostgap.py --variants bf16 fp8jax_delayed --out /tmp/hg1 2>&1 | flt > $OUT/A_hostgap_nocb.log ) &
wait
tar czf $OUT/atc.tgz .dev/atc
tail -n 3 $OUT/A_pytest_gpu.log
cat $OUT/A_hostgap.log | cut -c1-200 | head -150

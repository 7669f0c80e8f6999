#!/bin/bash
# 10D: GPU tests of the norm kernel with both GPUs visible (one_device fixture); GPU 0: GPT medium A/B
# (HEAD / EXP_NOLN=1), GPU 1: layer A/B of the residual aliased to dx (EXP_ALIAS=1) for peak memory.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-370} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_norm_backward.py tests/ops/test_fused.py 2>&1 | flt > $OUT/D_pytest_gpu.log
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/gpt_ab.py --config medium --mesh "" --no-bf16 --exps "" "EXP_NOLN=1" --rounds 1 --out $OUT/D_gpt1_ab.json 2>&1 | flt | ts > $OUT/D_gpt1_ab.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_ALIAS=1" "" "EXP_ALIAS=1" --out $OUT/D_layer_alias.json 2>&1 | flt | ts > $OUT/D_layer_alias.log ) &
wait
tail -n 3 $OUT/D_pytest_gpu.log
for f in $OUT/D_gpt1_ab.log $OUT/D_layer_alias.log; do echo "=== $f"; grep "x (\|x  \|rror\|ms\b\|GiB" $f | cut -c1-190 | tail -12; done

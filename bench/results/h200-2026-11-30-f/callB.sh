#!/bin/bash
# B (session 2026-11-30 f): the cast-transpose kernel for every kernel and output gradient ("")
# against the committed behaviour, kernel only for the MLP's pre-activation gradient
# (EXP_ONLYDPRE=1), same process, alternating, --loss mean. First the GPU tests.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-520} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_fused.py tests/sharding/test_live_gpus.py 2>&1 | flt > $OUT/B_pytest_gpu.log
mkdir -p /tmp/tr0 /tmp/tr1
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_ONLYDPRE=1" "" "EXP_ONLYDPRE=1" --trace /tmp/tr0 --out $OUT/B_layer.json 2>&1 | flt > $OUT/B_layer.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts gelu,linear --loss mean --exps "" "EXP_ONLYDPRE=1" "" "EXP_ONLYDPRE=1" --out $OUT/B_geglu.json 2>&1 | flt > $OUT/B_geglu.log
  CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts gelu --loss mean --exps "" "EXP_ONLYDPRE=1" --out $OUT/B_gelu.json 2>&1 | flt > $OUT/B_gelu.log ) &
wait
tail -2 $OUT/B_pytest_gpu.log
for f in $OUT/B_layer.log $OUT/B_geglu.log $OUT/B_gelu.log; do echo "=== $f"; grep "x (\|rror" $f | cut -c1-170; done
grep -A13 "^\[base\]" $OUT/B_layer.log | head -30

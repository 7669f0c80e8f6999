#!/bin/bash
# 9C: activation kernels with ex2/rcp.approx sigmoid. GPU 0: microbench, GPU tests, layer mean A/B (traced).
# GPU 1: layer square A/B (traced).
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-560} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
mkdir -p /tmp/tr0 /tmp/tr1
( CUDA_VISIBLE_DEVICES=0 timeout 100 python3 .dev/actbench.py gelu_tanh 2>&1 | flt > $OUT/C_actbench_gelu.log
  CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_activation_cast.py 2>&1 | flt > $OUT/C_pytest_gpu.log
  cd bench; CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_NOACT=1" "" "EXP_NOACT=1" --trace /tmp/tr0 --out $OUT/C_layer_ab.json 2>&1 | flt > $OUT/C_layer_ab.log ) &
( cd bench; CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss square --exps "EXP_NOACT=1" "" "EXP_NOACT=1" "" --trace /tmp/tr1 --out $OUT/C_layer_ab_square.json 2>&1 | flt > $OUT/C_layer_ab_square.log ) &
wait
cat $OUT/C_actbench_gelu.log | grep " ms\|FAIL"
tail -n 4 $OUT/C_pytest_gpu.log
for f in $OUT/C_layer_ab.log $OUT/C_layer_ab_square.log; do echo "=== $f"; grep "x (\|rror" $f | cut -c1-170; done

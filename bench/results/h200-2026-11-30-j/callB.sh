#!/bin/bash
# 10B: the one-pass norm backward kernel. GPU 0: the kernel alone over tiles (picks the best), then the
# layer A/B (mean loss, traced) with it against XLA's passes (EXP_NOLN=1). GPU 1: GPU tests, then the
# gelu MLP block A/B.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-560} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
( CUDA_VISIBLE_DEVICES=0 timeout 150 python3 .dev/lnbench.py 16384 4096 /tmp/best 2>&1 | flt > $OUT/B_lnbench.log
  export $(cat /tmp/best)
  cd bench; CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_NOLN=1" "" "EXP_NOLN=1" --trace /tmp/tr0 --out $OUT/B_layer_ab.json 2>&1 | flt > $OUT/B_layer_ab.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_norm_backward.py tests/ops/test_fused.py 2>&1 | flt > $OUT/B_pytest_gpu.log
  while [ ! -s /tmp/best ] && [ $(left) -gt 300 ]; do sleep 5; done; export $(cat /tmp/best)
  cd bench; CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts gelu --loss mean --exps "EXP_NOLN=1" "" "EXP_NOLN=1" "" --trace /tmp/tr1 --out $OUT/B_gelu_ab.json 2>&1 | flt > $OUT/B_gelu_ab.log ) &
wait
tar czf $OUT/atc.tgz .dev/atc
cat /tmp/best; echo
grep "ms\|best" $OUT/B_lnbench.log | cut -c1-150
tail -n 3 $OUT/B_pytest_gpu.log
for f in $OUT/B_layer_ab.log $OUT/B_gelu_ab.log; do echo "=== $f"; grep "x (\|rror\|norm_backward\|kernels\|fusion_9" $f | cut -c1-170; done

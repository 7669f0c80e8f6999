#!/bin/bash
# L3: the layer with the norm forward kernel at 8 rows a program, 2 a step, 4 warps; alternating
# builds in one process, three rounds; ced87ee's library in another process; the norm tests.
export PYTHONUNBUFFERED=1
R=$PWD
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
PYTHONPATH=$R/src XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_norm_forward.py tests/ops/test_fused.py 2>&1 | flt > $OUT/L3_pytest_gpu.log
cd bench
PYTHONPATH=$R/src:$R/bench XLA_FLAGS="$AT" timeout 200 python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_NONORMFWD=1" "EXP_NOSTACK=1" "" "EXP_NONORMFWD=1" "EXP_NOSTACK=1" "" "EXP_NONORMFWD=1" "EXP_NOSTACK=1" --trace /tmp/tr0 --out $OUT/L3_layer_ab.json 2>&1 | flt | ts > $OUT/L3_layer_ab.log
PYTHONPATH=$R/.dev/head/src:$R/bench XLA_FLAGS="$AT" timeout 100 python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "" "" --out $OUT/L3_layer_head.json 2>&1 | flt | ts > $OUT/L3_layer_head.log
cd $R
tail -n 2 $OUT/L3_pytest_gpu.log; grep "^FAILED" $OUT/L3_pytest_gpu.log
for f in $OUT/L3_layer_ab.log $OUT/L3_layer_head.log; do echo "=== $f"; grep "x (\|rror\|norm_forward" $f | cut -c1-200 | tail -24; done

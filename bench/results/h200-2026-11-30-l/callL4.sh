#!/bin/bash
# L4: maxima reduced in the group update (EXP_NODEFER=1 reduces each first); alternating builds in
# one process, three rounds; ced87ee's library in another process; the GPU tests; SwiGLU and GeGLU.
export PYTHONUNBUFFERED=1
R=$PWD
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
PYTHONPATH=$R/src XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | flt > $OUT/L4_pytest_gpu.log
cd bench
PYTHONPATH=$R/src:$R/bench XLA_FLAGS="$AT" timeout 200 python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_NODEFER=1" "EXP_NONORMFWD=1" "" "EXP_NODEFER=1" "EXP_NONORMFWD=1" "" "EXP_NODEFER=1" "EXP_NONORMFWD=1" --trace /tmp/tr0 --out $OUT/L4_layer_ab.json 2>&1 | flt | ts > $OUT/L4_layer_ab.log
PYTHONPATH=$R/.dev/head/src:$R/bench XLA_FLAGS="$AT" timeout 100 python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "" "" --out $OUT/L4_layer_head.json 2>&1 | flt | ts > $OUT/L4_layer_head.log
PYTHONPATH=$R/src:$R/bench XLA_FLAGS="$AT" timeout 120 python3 $R/.dev/sweep.py --case mlp --acts silu,linear --loss mean --exps "" "EXP_NODEFER=1 EXP_NONORMFWD=1 EXP_NOSTACK=1" "" --out $OUT/L4_swiglu_ab.json 2>&1 | flt | ts > $OUT/L4_swiglu_ab.log
cd $R
tar czf $OUT/atc.tgz .dev/atc
tail -n 2 $OUT/L4_pytest_gpu.log; grep "^FAILED" $OUT/L4_pytest_gpu.log
for f in $OUT/L4_layer_ab.log $OUT/L4_layer_head.log $OUT/L4_swiglu_ab.log; do echo "=== $f"; grep "x (\|rror\|norm_forward" $f | cut -c1-200 | tail -24; done

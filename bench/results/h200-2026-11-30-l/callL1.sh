#!/bin/bash
# L1: the group update (EXP_NOSTACK=1 turns it off), the norm's forward kernel (EXP_NONORMFWD=1
# turns it off) and per-tile amax, against each other in one process and against ced87ee's library
# in another; every GPU test; the SwiGLU block.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-575} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd bench
PYTHONPATH=$R/src:$R/bench XLA_FLAGS="$AT" timeout 150 python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_NOSTACK=1" "EXP_NONORMFWD=1" "EXP_NOSTACK=1 EXP_NONORMFWD=1" "" --trace /tmp/tr0 --out $OUT/L1_layer_ab.json 2>&1 | flt | ts > $OUT/L1_layer_ab.log
PYTHONPATH=$R/.dev/head/src:$R/bench XLA_FLAGS="$AT" timeout 100 python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "" --out $OUT/L1_layer_head.json 2>&1 | flt | ts > $OUT/L1_layer_head.log
cd $R
PYTHONPATH=$R/src XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | flt > $OUT/L1_pytest_gpu.log
cd bench
PYTHONPATH=$R/src:$R/bench XLA_FLAGS="$AT" timeout $(( $(left) - 15 )) python3 $R/.dev/sweep.py --case mlp --acts silu,linear --loss mean --exps "" "EXP_NOSTACK=1 EXP_NONORMFWD=1" "" --out $OUT/L1_swiglu_ab.json 2>&1 | flt | ts > $OUT/L1_swiglu_ab.log
cd $R
tar czf $OUT/atc.tgz .dev/atc
tail -n 5 $OUT/L1_pytest_gpu.log
for f in $OUT/L1_layer_ab.log $OUT/L1_layer_head.log $OUT/L1_swiglu_ab.log; do echo "=== $f"; grep "x (\|rror\|compile\|Trace" $f | cut -c1-230 | tail -14; done

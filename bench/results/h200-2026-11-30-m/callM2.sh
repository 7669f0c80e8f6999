#!/bin/bash
# M2: the gradient kernel's store order: kernels alone, the layer and the SwiGLU block in-process A/B.
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd $R/.dev && timeout 120 python3 kbench5.py 2>&1 | flt | ts > $OUT/M2_kbench5.log
cd $R/bench
XLA_FLAGS="$AT" timeout 200 python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_OLDORDER=1" "" "EXP_OLDORDER=1" --trace /tmp/trl --out $OUT/M2_layer_ab.json 2>&1 | flt | ts > $OUT/M2_layer_ab.log
XLA_FLAGS="$AT" timeout 150 python3 $R/.dev/sweep.py --case mlp --acts silu,linear --loss mean --exps "" "EXP_OLDORDER=1" "" "EXP_OLDORDER=1" --out $OUT/M2_swiglu_ab.json 2>&1 | flt | ts > $OUT/M2_swiglu_ab.log
cd $R; tar czf $OUT/atc.tgz .dev/atc
cat $OUT/M2_kbench5.log
for f in $OUT/M2_layer_ab.log $OUT/M2_swiglu_ab.log; do echo "=== $f"; grep "x (\|cast_activation_gradient\|rror" $f | cut -c1-200 | tail -14; done

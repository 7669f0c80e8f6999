#!/bin/bash
# M4: the gradient kernel's order A (dh read before h_t's store) against the old order, in-process A/Bs.
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd $R/bench
XLA_FLAGS="$AT" timeout 200 python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_ORDER=old" "" "EXP_ORDER=old" --trace /tmp/trl --out $OUT/M4_layer_ab.json 2>&1 | flt | ts > $OUT/M4_layer_ab.log
for acts in gelu,linear gelu silu,linear; do
XLA_FLAGS="$AT" timeout 120 python3 $R/.dev/sweep.py --case mlp --acts $acts --loss mean --exps "" "EXP_ORDER=old" "" "EXP_ORDER=old" --trace /tmp/trm --out $OUT/M4_mlp_${acts/,/_}_ab.json 2>&1 | flt | ts > $OUT/M4_mlp_${acts/,/_}_ab.log
done
cd $R; tar czf $OUT/atc.tgz .dev/atc
for f in $OUT/M4_*.log; do echo "=== $f"; grep "x (\|cast_activation_gradient\|rror" $f | cut -c1-200 | tail -14; done

#!/bin/bash
# K3: QKV split with the bias added in 5-D (EXP_SPLIT=1) or 2-D behind a barrier (EXP_BIASBAR=1); with EXP_STATE=v2.
# materializes each bias piece), live HLO dumped; host cost of outputs, inputs and kernels.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-575} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd bench
( XLA_FLAGS="$AT" timeout $(( $(left) - 90 )) python3 $R/.dev/sweep.py --case layer --loss mean --iters 40 --exps "" "EXP_SPLIT=1" "EXP_SPLIT=1 EXP_BIASBAR=1" "EXP_SPLIT=1 EXP_STATE=v2" "" "EXP_SPLIT=1" "EXP_SPLIT=1 EXP_BIASBAR=1" "EXP_SPLIT=1 EXP_STATE=v2" --trace /tmp/tr0 --dump-hlo /tmp/hlo --out $OUT/K3_layer_ab.json 2>&1 | flt | ts > $OUT/K3_layer_ab.log )
cd $R
tar czf $OUT/hlo.tgz -C /tmp hlo
tar czf $OUT/atc.tgz .dev/atc
for f in $OUT/K3_layer_ab.log $OUT/K3_hostgap.log; do echo "=== $f"; grep "x (\|x  \|rror\|median\|step 2\|compile" $f | cut -c1-220 | tail -24; done

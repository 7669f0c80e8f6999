#!/bin/bash
# U: interleaved gated pre-activation (EXP_IL), direct f8 activation under delayed scaling (EXP_FWD).
# case, one BF16 baseline each; XLA's per-fusion autotune cache persisted (to carry next time).
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-540} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p $OUT/logs $R/.dev/atc
export PYTHONPATH=$R/src:$R/bench
export XLA_FLAGS="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
cd bench
sw() { local gpu=$1 tag=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout $(left) python3 $R/.dev/sweep.py --out $OUT/$tag.json --trace /tmp/tr_$tag "$@" 2>&1 | grep --line-buffered -v "^W0000\|^I0000\|^E0000" | while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done > $OUT/logs/$tag.log; }
( sw 0 U_geglu --case mlp --acts gelu,linear --exps "" "EXP_IL=1" "EXP_IL=1 EXP_FWD=1" "EXP_FWD=1" "EXP_IL=1" ""
  sw 0 U_layer --case layer --exps "" "EXP_FWD=1" "" ) &
( sw 1 U_swiglu --case mlp --acts silu,linear --exps "" "EXP_IL=1" "EXP_IL=1 EXP_FWD=1" "" ) &
wait
du -sh $R/.dev/atc; ls $R/.dev/atc | wc -l
tar czf $OUT/atc.tar.gz -C $R/.dev atc
tar czf $OUT/logs.tar.gz -C $OUT logs
for f in $OUT/logs/*.log; do echo "=== $f"; grep -v "Traceback\|File \"\|^\S* *\^" $f | grep "x (\|compile\|ms:\|      0\.\|Error\|error" | cut -c1-190; done
rm -rf $OUT/logs

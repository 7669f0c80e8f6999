#!/bin/bash
# K8: the history shifted by a pad (7a61e78) against the roll (EXP_OLDSTATE=1): layer A/B and the
# GPT medium step, each row heated; then every GPU test at HEAD's library.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-575} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd bench
XLA_FLAGS="$AT" timeout 120 python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_OLDSTATE=1" "" "EXP_OLDSTATE=1" --trace /tmp/tr0 --out $OUT/K8_layer_ab.json 2>&1 | flt | ts > $OUT/K8_layer_ab.log
cd $R
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | flt > $OUT/K8_pytest_gpu.log
cd bench
XLA_FLAGS="$AT" timeout $(( $(left) - 20 )) python3 $R/.dev/gpt_ab.py --config medium --mesh "" --no-bf16 --exps "" "EXP_OLDSTATE=1" --rounds 1 --out $OUT/K8_gpt1_ab.json 2>&1 | flt | ts > $OUT/K8_gpt1_ab.log
cd $R
tar czf $OUT/atc.tgz .dev/atc
tail -n 3 $OUT/K8_pytest_gpu.log
for f in $OUT/K8_layer_ab.log $OUT/K8_gpt1_ab.log; do echo "=== $f"; grep "x (\|rror\|r0:\|compile\|tokens" $f | cut -c1-230 | tail -14; done

#!/bin/bash
# K7: HEAD's layer and MLP rows with each row heated to the power-capped steady state (--heat 3,
# the new default) and its SM clock recorded.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-575} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd bench
XLA_FLAGS="$AT" timeout 230 python3 layer.py --iters 20 --variants bf16 flax_fp8_direct flax_fp8_qdq fp8jax_current fp8jax_delayed --trace /tmp/layer --out $OUT/K7_layer.json 2>&1 | flt | ts > $OUT/K7_layer.log
XLA_FLAGS="$AT" timeout $(( $(left) - 20 )) python3 mlp.py --activations silu,linear gelu,linear gelu --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --trace /tmp/mlp --out $OUT/K7_mlp.json 2>&1 | flt | ts > $OUT/K7_mlp.log
cd $R
tar czf $OUT/atc.tgz .dev/atc
for f in $OUT/K7_layer.log $OUT/K7_mlp.log; do echo "=== $f"; grep "x  \|rror\|SM \|^.\{9\}[A-Za-z].*fwd" $f | cut -c1-250 | tail -30; done

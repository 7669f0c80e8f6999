#!/bin/bash
# K9: HEAD's (7a61e78) layer and MLP rows, heated.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-250} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd bench
XLA_FLAGS="$AT" timeout 100 python3 layer.py --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --trace /tmp/layer --out $OUT/K9_layer.json 2>&1 | flt | ts > $OUT/K9_layer.log
XLA_FLAGS="$AT" timeout $(( $(left) - 10 )) python3 mlp.py --activations silu,linear gelu,linear gelu --iters 20 --variants bf16 fp8jax_delayed --trace /tmp/mlp --out $OUT/K9_mlp.json 2>&1 | flt | ts > $OUT/K9_mlp.log
for f in $OUT/K9_layer.log $OUT/K9_mlp.log; do echo "=== $f"; grep "x  \|rror\|SM \|fwd" $f | cut -c1-250 | tail -20; done

#!/bin/bash
# L7: more samples of the committed library's (ce82a66) layer and gelu-block rows, heated, each
# in a process of its own.
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd bench
for i in 1 2 3; do
XLA_FLAGS="$AT" timeout 80 python3 layer.py --iters 20 --variants bf16 fp8jax_delayed --out $OUT/L7_layer_$i.json 2>&1 | flt | ts > $OUT/L7_layer_$i.log
done
for i in 1 2; do
XLA_FLAGS="$AT" timeout 60 python3 mlp.py --activations gelu --iters 20 --variants bf16 fp8jax_delayed --out $OUT/L7_gelu_$i.json 2>&1 | flt | ts > $OUT/L7_gelu_$i.log
done
cd $R
for f in $OUT/L7_*.log; do echo "=== $f"; grep "x  \|rror\|SM " $f | cut -c1-200 | tail -4; done

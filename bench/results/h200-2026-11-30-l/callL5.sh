#!/bin/bash
# L5: the final library's rows, heated: the layer twice (two processes), the MLP blocks; every GPU
# test at this library.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-560} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd bench
XLA_FLAGS="$AT" timeout 150 python3 layer.py --iters 20 --variants bf16 flax_fp8_direct fp8jax_current fp8jax_delayed --trace /tmp/layer --out $OUT/L5_layer.json 2>&1 | flt | ts > $OUT/L5_layer.log
XLA_FLAGS="$AT" timeout 100 python3 layer.py --iters 20 --variants bf16 fp8jax_delayed --out $OUT/L5_layer_again.json 2>&1 | flt | ts > $OUT/L5_layer_again.log
XLA_FLAGS="$AT" timeout 150 python3 mlp.py --activations silu,linear gelu,linear gelu --iters 20 --variants bf16 fp8jax_delayed --trace /tmp/mlp --out $OUT/L5_mlp.json 2>&1 | flt | ts > $OUT/L5_mlp.log
cd $R
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout $(( $(left) - 10 )) python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | flt > $OUT/L5_pytest_gpu.log
tar czf $OUT/atc.tgz .dev/atc
tail -n 2 $OUT/L5_pytest_gpu.log; grep "^FAILED" $OUT/L5_pytest_gpu.log
for f in $OUT/L5_layer.log $OUT/L5_layer_again.log $OUT/L5_mlp.log; do echo "=== $f"; grep "x  \|rror\|SM \|fwd" $f | cut -c1-250 | tail -20; done

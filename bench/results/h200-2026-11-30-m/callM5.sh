#!/bin/bash
# M5: the committed library's rows, heated: the layer (five processes), the MLP blocks (two), every GPU test.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-580} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd bench
XLA_FLAGS="$AT" timeout 150 python3 layer.py --iters 20 --variants bf16 flax_fp8_direct fp8jax_current fp8jax_delayed --trace /tmp/layer --out $OUT/M5_layer.json 2>&1 | flt | ts > $OUT/M5_layer.log
for i in 2 3 4 5; do
XLA_FLAGS="$AT" timeout 60 python3 layer.py --iters 20 --variants bf16 fp8jax_delayed --out $OUT/M5_layer_$i.json 2>&1 | flt | ts > $OUT/M5_layer_$i.log
done
XLA_FLAGS="$AT" timeout 80 python3 mlp.py --activations silu,linear gelu,linear gelu --iters 20 --variants bf16 fp8jax_delayed --trace /tmp/mlp --out $OUT/M5_mlp.json 2>&1 | flt | ts > $OUT/M5_mlp.log
XLA_FLAGS="$AT" timeout 70 python3 mlp.py --activations silu,linear gelu,linear gelu --iters 20 --variants bf16 fp8jax_delayed --out $OUT/M5_mlp_2.json 2>&1 | flt | ts > $OUT/M5_mlp_2.log
cd $R
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout $(( $(left) - 5 )) python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | flt > $OUT/M5_pytest_gpu.log
tail -n 2 $OUT/M5_pytest_gpu.log; grep "^FAILED" $OUT/M5_pytest_gpu.log
for f in $OUT/M5_layer*.log $OUT/M5_mlp*.log; do echo "=== $f"; grep "x  \|rror" $f | cut -c1-160 | tail -8; done

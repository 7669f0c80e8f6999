#!/bin/bash
# X: the GPU-marked tests at 0f… (interleaved layout, both GPUs), then the layer and the gelu/GeGLU
# MLP with --loss square (a loss whose gradient depends on the output) next to Flax direct.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-530} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p $OUT/logs
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
FP8JAX_TEST_GPU=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_fused.py tests/sharding/test_live_gpus.py 2>&1 | flt | ts > $OUT/logs/X_pytest_gpu.log
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 layer.py --loss square --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --out $OUT/X_layer_square.json 2>&1 | flt | ts > $OUT/logs/X_layer_square.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 mlp.py --loss square --activations gelu gelu,linear --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --out $OUT/X_mlp_square.json 2>&1 | flt | ts > $OUT/logs/X_mlp_square.log ) &
wait
tar czf $OUT/logs.tar.gz -C $OUT logs
tail -6 $OUT/logs/X_pytest_gpu.log
for f in $OUT/logs/X_*square.log; do echo "=== $f"; grep -v "Traceback\|File \"" $f | grep "ms (\|x  \|error\|Error" | cut -c1-170 | tail -14; done
rm -rf $OUT/logs

#!/bin/bash
# M (session 2026-11-30 e): the GPU tests, then the MLP and layer rows with the Pallas cast_transpose
# kernel (working tree = the commit that adds it), --loss mean. GPU 0: mlp.py; GPU 1: layer.py.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-520} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_fused.py tests/sharding/test_live_gpus.py 2>&1 | flt | ts > $OUT/M_pytest_gpu.log
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 mlp.py --activations gelu,linear silu,linear gelu --iters 20 \
    --variants bf16 flax_fp8_direct fp8jax_delayed --out $OUT/M_mlp.json 2>&1 | flt | ts > $OUT/M_mlp.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 layer.py --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed \
    --out $OUT/M_layer.json 2>&1 | flt | ts > $OUT/M_layer.log ) &
wait
tail -3 $OUT/M_pytest_gpu.log
for f in $OUT/M_mlp.log $OUT/M_layer.log; do echo "=== $f"; grep -v "Traceback\|File \"" $f | grep "x  \|rror" | cut -c1-170 | tail -12; done

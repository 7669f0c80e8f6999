#!/bin/bash
# D (session 2026-11-30 f): GPU tests (ops on one GPU, live sharding on two), then the activation
# computed in the cast-transpose kernel ("") against without (EXP_NOACT=1), layer, --loss mean,
# alternating, on GPU 0; GPU 1: the layer's square-loss rows, then the MLP rows (mean loss).
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-470} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_fused.py 2>&1 | flt > $OUT/D_pytest_gpu.log &
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/sharding/test_live_gpus.py 2>&1 | flt > $OUT/D_pytest_gpu2.log
wait
mkdir -p /tmp/tr0
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_NOACT=1" "" "EXP_NOACT=1" --trace /tmp/tr0 --out $OUT/D_layer_ab.json 2>&1 | flt > $OUT/D_layer_ab.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 layer.py --loss square --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed \
    --out $OUT/D_layer_square.json 2>&1 | flt | ts > $OUT/D_layer_square.log
  CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 mlp.py --activations gelu,linear silu,linear gelu --iters 20 \
    --variants bf16 flax_fp8_direct fp8jax_delayed --out $OUT/D_mlp.json 2>&1 | flt | ts > $OUT/D_mlp.log ) &
wait
tail -1 $OUT/D_pytest_gpu.log $OUT/D_pytest_gpu2.log
echo "=== ab"; grep "x (\|rror\|compile" $OUT/D_layer_ab.log | cut -c1-170
grep -A12 "^\[base\]" $OUT/D_layer_ab.log | head -15
for f in $OUT/D_layer_square.log $OUT/D_mlp.log; do echo "=== $f"; grep -v "Traceback\|File \"" $f | grep "x  \|rror" | cut -c1-170 | tail -14; done

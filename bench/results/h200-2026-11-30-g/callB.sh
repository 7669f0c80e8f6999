#!/bin/bash
# B7 (session 2026-11-30 g): the rows and GPU tests of the QKV split. Both GPUs: the live sharding tests.
# GPU 0: the layer's five variants (mean loss), then the square-loss rows. GPU 1: the ops' GPU tests,
# then GPT medium (bf16, fp8jax delayed).
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-570} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/sharding/test_live_gpus.py 2>&1 | flt > $OUT/B_pytest_gpu2.log
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 layer.py --iters 20 --variants bf16 flax_fp8_direct flax_fp8_qdq fp8jax_current fp8jax_delayed \
    --out $OUT/B_layer.json 2>&1 | flt | ts > $OUT/B_layer.log
  CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 layer.py --loss square --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed \
    --out $OUT/B_layer_square.json 2>&1 | flt | ts > $OUT/B_layer_square.log ) &
( cd $R; CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_fused.py 2>&1 | flt > $OUT/B_pytest_gpu.log
  cd bench; CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 gpt.py --config medium --donate --variants bf16 fp8jax_delayed \
    --out $OUT/B_gpt_medium.json 2>&1 | flt | ts > $OUT/B_gpt_medium.log ) &
wait
tar czf $OUT/atc.tgz -C $R/.dev atc
tail -1 $OUT/B_pytest_gpu.log $OUT/B_pytest_gpu2.log
for f in $OUT/B_layer.log $OUT/B_layer_square.log $OUT/B_gpt_medium.log; do echo "=== $f"; grep -v "Traceback\|File \"" $f | grep "x  \|rror\|tok" | cut -c1-170 | tail -14; done

#!/bin/bash
# C (session 2026-11-30 d), HEAD fc95d17: the GPU-marked tests, then the MLP (GeGLU, SwiGLU) and
# layer rows next to BF16 and Flax direct, each loss on each GPU (two samples per row).
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-545} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p $OUT/logs
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_fused.py tests/sharding/test_live_gpus.py 2>&1 | flt | ts > $OUT/logs/C_pytest_gpu.log
cd bench
run() {  # gpu loss tag
  CUDA_VISIBLE_DEVICES=$1 XLA_FLAGS="$AT" timeout $(left) python3 mlp.py --loss $2 --activations gelu,linear silu,linear --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --out $OUT/C_mlp_$2_gpu$1.json 2>&1 | flt | ts > $OUT/logs/C_mlp_$2_gpu$1.log
  CUDA_VISIBLE_DEVICES=$1 XLA_FLAGS="$AT" timeout $(left) python3 layer.py --loss $2 --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --out $OUT/C_layer_$2_gpu$1.json 2>&1 | flt | ts > $OUT/logs/C_layer_$2_gpu$1.log
}
( run 0 square; run 0 mean ) &
( run 1 mean; run 1 square ) &
wait
tar czf $OUT/logs.tar.gz -C $OUT logs
tar czf $OUT/atc.tar.gz -C $R/.dev atc
tail -4 $OUT/logs/C_pytest_gpu.log
for f in $OUT/logs/C_[ml]*.log; do echo "=== $f"; grep -v "Traceback\|File \"" $f | grep "x  \|rror" | cut -c1-150 | tail -8; done
rm -rf $OUT/logs

#!/bin/bash
# N (session 2026-11-30 e): final HEAD: GPU tests, then one GeGLU/SwiGLU mlp.py row per GPU.
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_fused.py tests/sharding/test_live_gpus.py 2>&1 | flt > $OUT/N_pytest_gpu.log
cd bench
for g in 0 1; do (CUDA_VISIBLE_DEVICES=$g XLA_FLAGS="$AT" timeout 150 python3 mlp.py --activations gelu,linear silu,linear --iters 20 --variants bf16 fp8jax_delayed --out $OUT/N_mlp_gpu$g.json 2>&1 | flt > $OUT/N_mlp_gpu$g.log) & done; wait
tail -2 $OUT/N_pytest_gpu.log; for g in 0 1; do echo "== gpu$g"; grep "x  " $OUT/N_mlp_gpu$g.log | cut -c1-150; done

#!/bin/bash
# M2 (session 2026-11-30 e): the gated MLP rows of M again, on both GPUs at once (the command as run).
export PYTHONPATH=$PWD/src:$PWD/bench; AT="--xla_gpu_per_fusion_autotune_cache_dir=$PWD/.dev/atc"; cd bench; for g in 0 1; do (CUDA_VISIBLE_DEVICES=$g XLA_FLAGS="$AT" timeout 300 python3 mlp.py --activations gelu,linear silu,linear --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --out $OUT/M2_mlp_gpu$g.json 2>&1 | grep -v "^W0000\|^I0000\|^E0000" > $OUT/M2_mlp_gpu$g.log) & done; wait; for g in 0 1; do echo "== gpu$g"; grep "x  " $OUT/M2_mlp_gpu$g.log | cut -c1-150; done

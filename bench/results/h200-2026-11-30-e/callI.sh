#!/bin/bash
# I (session 2026-11-30 e): every variant of the MLP and layer rows, and the GPT medium step, on
# c5db886 (library code of fc95d17): the rows not re-timed since fc95d17 (non-gated gelu, current
# scaling, Flax QDQ, GPT). GPU 0: mlp.py; GPU 1: layer.py, then gpt.py.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-570} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
cd bench
mkdir -p $OUT/tr0 $OUT/tr1
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 mlp.py --activations gelu gelu,linear silu,linear --iters 20 \
    --variants bf16 flax_fp8_direct flax_fp8_qdq fp8jax_current fp8jax_delayed --trace $OUT/tr0 --out $OUT/I_mlp.json 2>&1 | flt | ts > $OUT/I_mlp.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 layer.py --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed fp8jax_current \
    --trace $OUT/tr1 --out $OUT/I_layer.json 2>&1 | flt | ts > $OUT/I_layer.log
  CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 gpt.py --config medium --donate --variants bf16 fp8jax_delayed fp8jax_current \
    --trace $OUT/tr1 --out $OUT/I_gpt_medium.json 2>&1 | flt | ts > $OUT/I_gpt_medium.log ) &
wait
rm -rf $OUT/tr0 $OUT/tr1
tar czf $OUT/atc.tar.gz -C $R/.dev atc
for f in $OUT/I_*.log; do echo "=== $f"; grep -v "Traceback\|File \"" $f | grep "x  \|x (\|rror\|ms/step\|tokens/s" | cut -c1-170 | tail -24; done

#!/bin/bash
# A (session 2026-11-30 f): per-kernel breakdown of the layer at HEAD 33ab20f, and cuDNN FP8 attention headroom.
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
XLA_FLAGS="$AT" timeout 120 python3 .dev/attn_fp8_bench.py 2>&1 | flt | ts > $OUT/A_attn.log
cd bench
XLA_FLAGS="$AT" timeout 300 python3 layer.py --iters 20 --variants bf16 fp8jax_delayed --trace /tmp/la \
    --out $OUT/A_layer.json 2>&1 | flt | ts > $OUT/A_layer.log
for k in gemm attention quantize fp8-relayout other; do python3 breakdown.py $OUT/A_layer.json --variants fp8jax_delayed --kind $k --top 40; done > $OUT/A_breakdown.txt 2>&1
cat $OUT/A_attn.log; grep "x  \|rror" $OUT/A_layer.log | tail -5; cat $OUT/A_breakdown.txt

#!/bin/bash
# B8: narrow-tile QKV pieces kernel (5b0c04f + EXP_JOIN switch). GPU 0: GPU tests (one GPU), then GPT
# medium 1-GPU A/B (joined first); GPU 1: the same A/B, pieces first, second round traced.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-545} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_fused.py tests/ops/test_cast_transpose.py 2>&1 | flt > $OUT/B_pytest_gpu.log
  CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 .dev/gpt_ab.py --config medium --mesh "" --exps "EXP_JOIN=1" "EXP_JOIN=0" --rounds 2 \
    --out $OUT/B_gpt1_gpu0.json 2>&1 | flt | ts > $OUT/B_gpt1_gpu0.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 .dev/gpt_ab.py --config medium --mesh "" --exps "EXP_JOIN=0" "EXP_JOIN=1" --rounds 2 --trace /tmp/trB \
    --out $OUT/B_gpt1_gpu1.json 2>&1 | flt | ts > $OUT/B_gpt1_gpu1.log ) &
wait
tar czf $OUT/atc.tgz -C $R/.dev atc
tail -n 3 $OUT/B_pytest_gpu.log
for f in $OUT/B_gpt1_gpu0.log $OUT/B_gpt1_gpu1.log; do echo "== $f"; grep -v "Traceback\|File \"" $f | grep "x (\|rror\|  [0-9]\.[0-9]\|tok" | cut -c1-180 | tail -32; done

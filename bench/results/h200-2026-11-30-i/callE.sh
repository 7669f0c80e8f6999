#!/bin/bash
# 9E: gated activation kernels with (64, 32) gradient tiles. GPU 0: MLP GeGLU then SwiGLU A/B
# (kernels vs EXP_NOACT=1), traced. GPU 1: GPT medium, one GPU, A/B.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-570} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
( cd bench; CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts gelu,linear --exps "" "EXP_NOACT=1" "" "EXP_NOACT=1" --trace /tmp/tr0 --out $OUT/E_geglu_ab.json 2>&1 | flt > $OUT/E_geglu_ab.log
  CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts silu,linear --exps "EXP_NOACT=1" "" "EXP_NOACT=1" "" --trace /tmp/tr0s --out $OUT/E_swiglu_ab.json 2>&1 | flt > $OUT/E_swiglu_ab.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 .dev/gpt_ab.py --config medium --mesh "" --exps "" "EXP_NOACT=1" --rounds 2 \
    --out $OUT/E_gpt1_ab.json 2>&1 | flt | ts > $OUT/E_gpt1_ab.log ) &
wait
tar czf $OUT/atc.tgz -C $R/.dev atc
for f in $OUT/E_geglu_ab.log $OUT/E_swiglu_ab.log; do echo "=== $f"; grep "x (\|rror" $f | cut -c1-170; done
echo "=== gpt"; grep -v "Traceback\|File \"" $OUT/E_gpt1_ab.log | grep "x (\|rror\|tok" | cut -c1-180 | tail -12

#!/bin/bash
# 9D: gated and erf-gelu activation kernels. GPU 0: microbench (GeGLU, SwiGLU, gelu), GPU tests,
# then MLP GeGLU A/B (kernels vs EXP_NOACT=1), gelu (erf) A/B. GPU 1: MLP SwiGLU A/B, layer A/B.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-570} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
mkdir -p /tmp/tr0 /tmp/tr1
( for a in gelu,linear silu,linear gelu; do CUDA_VISIBLE_DEVICES=0 timeout 80 python3 .dev/actbench.py $a 2>&1 | flt; done > $OUT/D_actbench.log
  CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_activation_cast.py tests/ops/test_fused.py 2>&1 | flt > $OUT/D_pytest_gpu.log
  cd bench; CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts gelu,linear --exps "" "EXP_NOACT=1" "" "EXP_NOACT=1" --trace /tmp/tr0 --out $OUT/D_geglu_ab.json 2>&1 | flt > $OUT/D_geglu_ab.log
  CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts gelu --exps "EXP_NOACT=1" "" "EXP_NOACT=1" "" --trace /tmp/tr0g --out $OUT/D_gelu_ab.json 2>&1 | flt > $OUT/D_gelu_ab.log ) &
( cd bench; CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts silu,linear --exps "EXP_NOACT=1" "" "EXP_NOACT=1" "" --trace /tmp/tr1 --out $OUT/D_swiglu_ab.json 2>&1 | flt > $OUT/D_swiglu_ab.log
  CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_NOACT=1" "" "EXP_NOACT=1" --out $OUT/D_layer_ab.json 2>&1 | flt > $OUT/D_layer_ab.log ) &
wait
tar czf $OUT/atc.tgz -C $R/.dev atc
grep " ms\|FAIL" $OUT/D_actbench.log | cut -c1-200
tail -n 4 $OUT/D_pytest_gpu.log
for f in $OUT/D_geglu_ab.log $OUT/D_gelu_ab.log $OUT/D_swiglu_ab.log $OUT/D_layer_ab.log; do echo "=== $f"; grep "x (\|rror" $f | cut -c1-170; done

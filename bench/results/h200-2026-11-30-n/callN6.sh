#!/bin/bash
# N6: the library with the norm kernels' loads issued ahead: the layer (five processes, the first traced), the MLP blocks, every GPU test.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-590} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd bench
XLA_FLAGS="$AT" timeout 120 python3 layer.py --iters 20 --variants bf16 fp8jax_delayed --trace /tmp/layer --out $OUT/N6_layer.json 2>&1 | flt | ts > $OUT/N6_layer.log
for i in 2 3 4 5; do
XLA_FLAGS="$AT" timeout 60 python3 layer.py --iters 20 --variants bf16 fp8jax_delayed --out $OUT/N6_layer_$i.json 2>&1 | flt | ts > $OUT/N6_layer_$i.log
done
XLA_FLAGS="$AT" timeout 80 python3 mlp.py --activations silu,linear gelu,linear gelu --iters 20 --variants bf16 fp8jax_delayed --trace /tmp/mlp --out $OUT/N6_mlp.json 2>&1 | flt | ts > $OUT/N6_mlp.log
cd $R
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout $(( $(left) - 8 )) python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | flt > $OUT/N6_pytest_gpu.log
cd $OUT
tail -n 2 N6_pytest_gpu.log; grep "^FAILED" N6_pytest_gpu.log
grep -h "x  \|  bf16:\|  fp8jax_delayed:\|norm_\|kernels " N6_layer*.log N6_mlp.log | cut -c1-190
tar czf N6.tgz N6_* && rm -f N6_*.json N6_layer_*.log

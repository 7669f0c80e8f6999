#!/bin/bash
# N3: where the synchronized layer step's time outside kernels goes (command buffers on/off);
# the MLP rows with the gated gradient's 32 x 64 tiles; the GPT medium step; every GPU test.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-590} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
XLA_FLAGS="$AT" timeout 90 python3 .dev/hostgap.py --case layer --variants bf16 fp8jax_delayed 2>&1 | flt > $OUT/N3_hostgap.log
XLA_FLAGS="$AT --xla_gpu_enable_command_buffer=" timeout 90 python3 .dev/hostgap.py --case layer --variants bf16 fp8jax_delayed 2>&1 | flt > $OUT/N3_hostgap_nocb.log
cd bench
XLA_FLAGS="$AT" timeout 80 python3 mlp.py --activations silu,linear gelu,linear gelu --iters 20 --variants bf16 fp8jax_delayed --out $OUT/N3_mlp.json 2>&1 | flt | ts > $OUT/N3_mlp.log
XLA_FLAGS="$AT" timeout 70 python3 mlp.py --activations silu,linear gelu,linear gelu --iters 20 --variants bf16 fp8jax_delayed --out $OUT/N3_mlp_2.json 2>&1 | flt | ts > $OUT/N3_mlp_2.log
XLA_FLAGS="$AT" timeout 240 python3 gpt.py --config medium --donate --variants bf16 fp8jax_delayed --out $OUT/N3_gpt_medium.json 2>&1 | flt | ts > $OUT/N3_gpt_medium.log
cd $R
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout $(( $(left) - 8 )) python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | flt > $OUT/N3_pytest_gpu.log
cd $OUT
tail -n 2 N3_pytest_gpu.log; grep "^FAILED" N3_pytest_gpu.log
grep -h "x  \|tokens/s\|  bf16:\|  fp8jax_delayed:" N3_mlp*.log N3_gpt*.log | cut -c1-190
grep -h "median\|step 2\|cuGraph\|host events" N3_hostgap*.log | cut -c1-160
tar czf N3.tgz N3_* && rm -f N3_mlp*.json N3_mlp_2.log N3_gpt_medium.json

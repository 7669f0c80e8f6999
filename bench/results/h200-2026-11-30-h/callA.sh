#!/bin/bash
# A8 (session 2026-11-30 h): the per-device cast kernel under data parallelism (00f7b52).
# Both GPUs: live GPU tests, then GPT medium fsdp=2 A/B in one process (bf16; fp8 delayed with
# FP8JAX_PALLAS=0 = the old sharded program, and with the kernel; two rounds, the second traced).
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-560} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/sharding/test_live_gpus.py tests/ops/test_fused.py 2>&1 | flt > $OUT/A_pytest_gpu.log
tail -n 3 $OUT/A_pytest_gpu.log
XLA_FLAGS="$AT" timeout $(left) python3 .dev/gpt_ab.py --config medium --mesh fsdp=2 --rounds 2 --trace /tmp/trA \
    --out $OUT/A_gpt_fsdp2_ab.json 2>&1 | flt | ts > $OUT/A_gpt_fsdp2_ab.log
tar czf $OUT/atc.tgz -C $R/.dev atc
grep -v "Traceback\|File \"" $OUT/A_gpt_fsdp2_ab.log | grep "x (\|rror\|tok\|  [0-9]\.[0-9]" | cut -c1-190 | tail -50

#!/bin/bash
# S: where does the first FP8 compile's ~150 s go (autotune cache / level / Triton GEMM off),
# and where does the synced call's wall-minus-kernel time go (host timeline, command buffers off).
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-560} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p $OUT/logs $OUT/atlogs
export PYTHONPATH=$R/src:$R/bench
cd bench
ov() { local gpu=$1 tag=$2 flags=$3; shift 3
  echo "$(date +%H:%M:%S) start $tag" >> $OUT/logs/$tag.log
  XLA_FLAGS="$flags" CUDA_VISIBLE_DEVICES=$gpu timeout $(left) python3 $R/.dev/overhead.py "$@" 2>&1 | grep --line-buffered -v "^W0000\|^I0000\|^E0000" | while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done >> $OUT/logs/$tag.log; }
( ov 0 A "--xla_gpu_per_fusion_autotune_cache_dir=/tmp/atc --xla_gpu_dump_autotune_logs_to=$OUT/atlogs/A" --variants fp8jax_delayed bf16 --trace /tmp/trA
  ov 0 B "--xla_gpu_per_fusion_autotune_cache_dir=/tmp/atc" --variants fp8jax_delayed
  ov 0 C "--xla_gpu_autotune_level=0" --variants fp8jax_delayed ) &
( ov 1 D "--xla_gpu_enable_command_buffer=" --variants fp8jax_delayed bf16 --trace /tmp/trD
  ov 1 E "--xla_gpu_enable_triton_gemm=false" --variants fp8jax_delayed ) &
wait
ls -la /tmp/atc | head; du -sh /tmp/atc $OUT/atlogs
tar czf $OUT/atlogs.tar.gz -C $OUT atlogs && rm -rf $OUT/atlogs
for f in $OUT/logs/*.log; do echo "=== $f"; grep -v "^\S* *$" $f | grep -v "cuda\|Traceback\|File \"" | head -120; done 2>&1 | cut -c1-200 | head -400

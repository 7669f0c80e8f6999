#!/bin/bash
# K5: per-output cost of a synchronized layer call (state dropped / packed), and GPU clocks and
# power while timing (nvidia-smi every 50 ms), synchronized and pipelined.
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S.%N | cut -c1-12) $l"; done; }
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv -lms 50 > $OUT/K5_smi.csv 2>&1 &
SMI=$!
cd bench
XLA_FLAGS="$AT" timeout 300 python3 $R/.dev/outcost.py 2>&1 | flt | ts > $OUT/K5_outcost.log
kill $SMI
cd $R
tar czf $OUT/atc.tgz .dev/atc
cat $OUT/K5_outcost.log | grep -v "^\s*$" | tail -30
head -3 $OUT/K5_smi.csv; wc -l $OUT/K5_smi.csv

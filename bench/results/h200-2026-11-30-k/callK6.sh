#!/bin/bash
# K6: the layer's ratios in cool bursts (6 s idle before 10 synchronized calls) and sustained
# (after 4 s back to back: under the power cap), with SM clocks and power every 50 ms.
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv -lms 50 > $OUT/K6_smi.csv 2>&1 &
SMI=$!
cd bench
XLA_FLAGS="$AT" timeout 540 python3 $R/.dev/powerbench.py 2>&1 | flt > $OUT/K6_power.log
kill $SMI
cd $R
tar czf $OUT/atc.tgz .dev/atc
grep -v "^\s*$" $OUT/K6_power.log | tail -30

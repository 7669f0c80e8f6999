#!/bin/bash
# 9B: standalone activation kernel timings over tiles/warps (gelu_tanh, then relu).
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
timeout 250 python3 .dev/actbench.py gelu_tanh 2>&1 | flt > $OUT/B_actbench_gelu.log
timeout 150 python3 .dev/actbench.py relu 2>&1 | flt > $OUT/B_actbench_relu.log
cat $OUT/B_actbench_gelu.log $OUT/B_actbench_relu.log | grep " ms\|FAIL"

#!/usr/bin/env bash
# compare --quick before and after the compare --long fold, on an emulated AVX2 machine (issue 47, 48)
export ROUTEFORMER_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
for side in before after; do
  cd /work/wt$side
  start=$(date +%s)
  PYTHONPATH=src python -m routeformer.cli compare --quick --out /work/main/runs/cq-$side > /work/main/runs/cq-$side.log 2>&1
  echo "$side rc=$? seconds=$(( $(date +%s) - start ))" >> /work/main/runs/cq-times.txt
done

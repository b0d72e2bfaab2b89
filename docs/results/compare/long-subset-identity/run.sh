#!/usr/bin/env bash
# compare --long subset before and after the fold (issue 48): recall at T=512, full and topk, seed 0.
for side in before after; do
  (cd /work/wt$side && OMP_NUM_THREADS=1 PYTHONPATH=src python -m routeformer.cli compare --long --tasks mqar_512 \
     --mechanisms full topk --seeds 1 --workers 1 --out /work/main/runs/ls-$side > /work/main/runs/ls-$side.log 2>&1; \
   echo "$side rc=$?" >> /work/main/runs/ls-done.txt) &
done
wait

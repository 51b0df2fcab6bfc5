#!/bin/bash
N=${1:-3}; W=${2:-shared-prompt}
for r in $(seq $N); do
  for t in old new; do
    if [ $t = old ]; then D=/tmp/old; else D=/work/main; fi
    (cd $D && PYTHONPATH=$D /work/main/.venv/bin/radixserve bench peers --workload $W --systems radixserve,radixserve-nospec --no-progress --no-charts --out /tmp/s/peers/${t}_$r > /dev/null 2>&1)
    echo "$t $r $(grep -A4 '^| system' /tmp/s/peers/${t}_$r/table.md | grep '^| radixserve' | awk -F'|' '{printf "%s %s %s; ", $2, $3, $4}')"
  done
done

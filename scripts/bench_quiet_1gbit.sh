#!/usr/bin/env bash
# Issue 16's step-time and mid-size figures on a quiet many-core machine (a lent GPU machine:
# 16 cores, nothing else running), where the 2-core development machine is CPU-bound.
# Two ranks on this host talk over loopback, shaped with tc tbf to LINK (default 2gbit: loopback
# has one queue for both directions, so 2 Gbit/s in all is 1 Gbit/s each way, as between two
# hosts on a 1 Gbit/s link). Needs root and tc; SHAPE=0 skips the shaping (a smoke run).
# Results go to $OUT (default /tmp): quiet.log and one JSON per run. Every part is bounded.
#
#     bash scripts/bench_quiet_1gbit.sh            # as root on the quiet machine
#     SHAPE=0 MODEL=mlp-1m STEPS=2 bash scripts/bench_quiet_1gbit.sh   # a quick smoke run
#     THREADS=1 LANES= bash scripts/bench_quiet_1gbit.sh   # one thread per rank, no allreduce runs
set -uo pipefail
OUT="${OUT:-/tmp}"
PY="${PY:-python3}"
LINK="${LINK:-2gbit}"
MODEL="${MODEL:-transformer-25m}"
STEPS="${STEPS:-8}"
THREADS="${THREADS:-4}"
# Shaped loopback (2 Gbit/s in all) measures about 250 MB/s, the boundary of the engine's link
# classes, and comes out "fast" (32 MiB buckets); a real 1 Gbit/s link is "slow" (4 MiB). So the
# ringtrain variants pin the class a 1 Gbit/s link gets; CLASS= leaves it to the measurement.
if [ "${SHAPE:-1}" = 1 ]; then CLASS="${CLASS-@link=slow}"; else CLASS="${CLASS-}"; fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS

shaped=0
if [ "${SHAPE:-1}" = 1 ]; then
    if tc qdisc replace dev lo root tbf rate "$LINK" burst 4mb latency 100ms; then
        shaped=1
        trap 'tc qdisc del dev lo root 2>/dev/null' EXIT
    else
        echo "could not shape loopback: figures below are unshaped" >&2
    fi
fi
{
    echo "date: $(date -u +%FT%TZ)  cores: $(nproc)  loopback shaped: $shaped ($LINK)"
    "$PY" -c 'import torch; print("torch", torch.__version__)'
    uptime
} | tee "$OUT/quiet.log"

train() {  # optimizer compression
    timeout 150 "$PY" -m ringtrain.bench train -np 2 --threads "$THREADS" --model "$MODEL" \
        --optimizer "$1" --compression "$2" \
        --variants "${VARIANTS:-ringtrain$CLASS,ringtrain$CLASS@whole=1,ringtrain$CLASS@overlap=1,ddp,nocomm}" \
        --steps "$STEPS" --block 4 --warmup 2 --markdown \
        --json "$OUT/quiet-train-$1-$2.json" 2>&1 | tee -a "$OUT/quiet.log"
    echo "train $1 $2: exit ${PIPESTATUS[0]} at $((SECONDS - start)) s"
}

train momentum none
train momentum fp16
train adam none
for lane in ${LANES-0 1}; do
    RINGTRAIN_FAST_LANE=$lane timeout 90 "$PY" -m ringtrain.bench allreduce -np 2 \
        --threads "$THREADS" --sizes 256K..4M:2 --repeats 5 --link-mbps 1000 \
        --fusion-repeats 0 --markdown --json "$OUT/quiet-allreduce-lane$lane.json" 2>&1 \
        | tee -a "$OUT/quiet.log"
    echo "allreduce lane=$lane: exit ${PIPESTATUS[0]} at $((SECONDS - start)) s"
done
uptime | tee -a "$OUT/quiet.log"

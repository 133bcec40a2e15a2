#!/usr/bin/env bash
# Issue 38's wall-time figures, for a machine with the cores (a lent GPU machine's host: 16
# cores): 8 ranks x 2 threads and 16 ranks x 1 thread on loopback, ringtrain against raw Gloo
# interleaved in the same processes (every size 64 KiB-16 MiB, and a burst of 256 x 64 KiB
# async ops against one tensor of its bytes); then, at the same shapes, where the burst's wall
# time goes (scripts/bench_burst_wall.py) and the rank-ordered sum that fused bursts take from
# 3 ranks, whole or in pipelined pieces (scripts/bench_ordered_pieces.py; ordered.PIECE_BYTES,
# off by default: on 2 cores pieces cost more); then CPU per op at 4 and 2 ranks, which on 16
# cores runs one rank per core (the 2-core machine runs 4 ranks two to a core); then one tiny
# value's latency by algorithm at 8 and 16 ranks (what a lane slot's agreement could run on);
# then a lane slot of 4 and 16 MiB by plan (agree, copy, or sum in rank order) at 8 x 2 and
# 16 x 1 (scripts/bench_lane_plan.py); then the burst at 8 ranks by the fused path's pipeline
# chunk size (execute.PIPELINE_CHUNK_BYTES, 16 MiB, chosen on 2 cores, where the copies cannot overlap
# Gloo: a 16 MiB burst is one chunk there).
#
# Run from the repository root with a torch-enabled python (PY, default python3; nothing is
# installed). Every part is bounded, the most wanted first, so that a run cut short still
# returns what it finished; the whole took 5 minutes on 16 cores (2026-12-04), before the
# tiny-value part was added. Results go to $OUT (default /tmp): scale.log and one JSON per part.
#
#     bash scripts/bench_scale_16core.sh
#     PY=.venv/bin/python QUICK=1 bash scripts/bench_scale_16core.sh   # a smoke run on 2 cores
set -uo pipefail
OUT="${OUT:-/tmp}"
PY="${PY:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
# QUICK=1: 2 and 3 ranks, two sizes, short bursts: checks the script, measures nothing.
if [ "${QUICK:-0}" = 1 ]; then
    WIDE="2x1 3x1" CPU_RANKS="2" SIZES="64K,1M" REPEATS=2 BURST=32 LIMIT=60 CHUNKS_NP=2
    TINY_RANKS="2" PLAN_SHAPES="3x1"
else
    WIDE="8x2 16x1" CPU_RANKS="4 2" SIZES="64K..16M:4" REPEATS=5 BURST=256 LIMIT=140 CHUNKS_NP=8
    TINY_RANKS="8 16" PLAN_SHAPES="8x2 16x1"
fi
start=$SECONDS
log="$OUT/scale.log"

{
    echo "date: $(date -u +%FT%TZ)  cores: $(nproc)  commit: $(git rev-parse --short HEAD 2>/dev/null)"
    "$PY" -c 'import torch; print("torch", torch.__version__)'
    uptime
} | tee "$log"

part() {  # name seconds command...: one bounded part, its exit code and the time so far logged
    local name=$1 limit=$2
    shift 2
    echo "== $name" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    echo "$name: exit ${PIPESTATUS[0]} at $((SECONDS - start)) s; $(uptime)" | tee -a "$log"
}

for shape in $WIDE; do  # RANKSxTHREADS: the done-when's wall-time cases
    np=${shape%x*} threads=${shape#*x}
    part "allreduce $np ranks x $threads threads" "$LIMIT" \
        "$PY" -m ringtrain.bench allreduce -np "$np" --threads "$threads" --sizes "$SIZES" \
        --repeats "$REPEATS" --fusion-count "$BURST" --fusion-size 65536 \
        --fusion-repeats "$REPEATS" --markdown --json "$OUT/scale-allreduce-$shape.json"
done
for shape in $WIDE; do  # where the burst's wall time goes (2.6-3.5x one tensor at 8 x 2)
    np=${shape%x*} threads=${shape#*x}
    part "burst wall by segment, $np ranks x $threads threads" $((LIMIT / 2)) \
        "$PY" -m ringtrain run -np "$np" -x OMP_NUM_THREADS="$threads" -- \
        "$PY" scripts/bench_burst_wall.py --count "$BURST" --samples "$((REPEATS * 4))"
    part "rank-ordered sum, whole or in pieces, $np ranks x $threads threads" $((LIMIT / 2)) \
        "$PY" -m ringtrain run -np "$np" -x OMP_NUM_THREADS="$threads" -- \
        "$PY" scripts/bench_ordered_pieces.py --mib 16 --pieces 0,4,2 --repeats "$REPEATS"
done
for np in $CPU_RANKS; do  # the done-when's CPU cases: 1 and 2 threads
    for threads in 1 2; do
        part "cpu $np ranks x $threads threads" $((LIMIT / 2)) \
            "$PY" -m ringtrain.bench cpu -np "$np" --threads "$threads" --sizes "$SIZES" \
            --repeats 4 --burst-count "$BURST" --markdown \
            --json "$OUT/scale-cpu-${np}x$threads.json"
    done
done
for np in $TINY_RANKS; do  # what a lane slot's agreement could run on (scripts/bench_tiny_latency.py)
    part "one tiny value by algorithm, $np ranks x 1 thread" $((LIMIT / 2)) \
        "$PY" -m ringtrain run -np "$np" -x OMP_NUM_THREADS=1 -- \
        "$PY" scripts/bench_tiny_latency.py --repeats "$REPEATS"
done
for shape in $PLAN_SHAPES; do  # how a slot above 1 MiB keeps its tensor (bench_lane_plan.py)
    np=${shape%x*} threads=${shape#*x}
    part "lane slot plans, $np ranks x $threads threads" "$LIMIT" \
        "$PY" -m ringtrain run -np "$np" -x OMP_NUM_THREADS="$threads" -- \
        "$PY" scripts/bench_lane_plan.py --repeats "$REPEATS"
done
part "burst by chunk size, $CHUNKS_NP ranks x 2 threads" "$LIMIT" \
    "$PY" -m ringtrain run -np "$CHUNKS_NP" -x OMP_NUM_THREADS=2 -- \
    "$PY" scripts/bench_fusion_chunks.py --count "$BURST" --burst --repeats "$REPEATS"
uptime | tee -a "$log"
echo "total $((SECONDS - start)) s; results in $OUT" | tee -a "$log"

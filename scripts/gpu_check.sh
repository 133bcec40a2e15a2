#!/usr/bin/env bash
# The GPU check: run from the repository root on a machine with a GPU and a CUDA build of torch
# (as `python3`; ringtrain itself is not installed, its dependencies must be importable:
# `cryptography` too, which the tests' cluster fixtures import; on a machine without it, put
# its wheels on PYTHONPATH first). Prints the machine's GPUs and versions, runs tests/gpu
# (CUDA tensors through every collective, the optimizer, SyncBatchNorm; skipped without CUDA),
# then, as time allows, the CPU collective suites, to show a CUDA-enabled torch breaks nothing.
# Every part is bounded; the whole script ends within 6 minutes. Logs go to $OUT (default /tmp).
#
#     bash scripts/gpu_check.sh
set -uo pipefail
OUT="${OUT:-/tmp}"
mkdir -p "$OUT"
export PYTHONPATH="src:tests${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS

echo "== machine"
timeout 20 nvidia-smi -L || echo "(nvidia-smi failed)"
timeout 60 python3 - <<'PY' 2>&1 | tee "$OUT/gpu_env.txt"
import sys

import torch
import torch.distributed as dist

print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda)
print("cuda available:", torch.cuda.is_available(), "| devices:", torch.cuda.device_count())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    pci = [getattr(p, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    print("device 0:", p.name, "| uuid", getattr(p, "uuid", None), "| pci", pci)
nccl = dist.is_nccl_available() and torch.cuda.is_available()
print("nccl available:", dist.is_nccl_available(), "| version", torch.cuda.nccl.version() if nccl else "-")
print("all_gather_single:", hasattr(dist, "all_gather_single"),
      "| reduce_scatter_single:", hasattr(dist, "reduce_scatter_single"))
try:
    import cryptography  # noqa: F401
    print("cryptography: installed")
except ImportError:  # ringtrain runs without it (only --secure needs it); its tests do not
    print("cryptography: not installed")
import ringtrain.torch  # noqa: F401  # the import path every job takes
print("ringtrain imports from", ringtrain.torch.__file__)
PY

if ! python3 -c 'import cryptography' 2>/dev/null; then
    echo "cryptography is missing: pytest cannot load the tests' fixtures (tests/_cluster_fixtures.py)."
    echo "Install it (pip install cryptography), or put its wheels (cryptography, cffi, pycparser) on PYTHONPATH."
    exit 2
fi

echo "== tests/gpu"
NCCL_DEBUG="${NCCL_DEBUG:-WARN}" timeout 280 python3 -m pytest -p no:cacheprovider -q -rA \
    tests/gpu tests/runtime/test_cuda_route.py --timeout 120 2>&1 | tee "$OUT/gpu.log"
gpu_rc=${PIPESTATUS[0]}
echo "tests/gpu exit code: $gpu_rc ($((SECONDS - start)) s so far)"

left=$((330 - (SECONDS - start)))
if [ "$left" -gt 30 ]; then
    echo "== CPU suites (up to $left s)"
    timeout "$left" python3 -m pytest -p no:cacheprovider -q -rfE --timeout 120 \
        tests/collectives/test_movement.py tests/collectives/test_allreduce.py 2>&1 \
        | tee "$OUT/cpu.log"
    echo "CPU suites exit code: ${PIPESTATUS[0]}"
else
    echo "== CPU suites skipped: only $left s left"
fi
echo "total $((SECONDS - start)) s; logs in $OUT"
exit "$gpu_rc"

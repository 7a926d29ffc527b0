#!/usr/bin/env bash
# One call on a GPU node with nothing else reachable: a venv, the GPU tests, every mode
# trained on the GPU, the GPU goals (benchmarks/gpu_workload.py), optionally the node
# scaling run, and a table printed last. Sized for under 5 minutes on one H100 (plus about
# 3 with --scaling: node_scaling.py's budget, SCALING_BUDGET seconds, default 150;
# GPU_ROUNDS=1 halves the goals' part).
# MPIPS_GPU_STANDIN=1 runs it without a GPU, on the stand-in: a check of the script itself,
# whose figures mean nothing.
#
#   benchmarks/gpu_check.sh [--wheels DIR] [--scaling] [--skip-tests] [--out DIR]
#
# The machine's python3 must have cupy (and numpy, h5py, numba, scipy, tqdm,
# threadpoolctl, pytest); what it lacks (an MPI runtime: the `mpich` and `mpi4py` wheels;
# `tensorboardX`) comes as wheels in DIR (default .whl), installed into a new venv whose
# site-packages also sees the machine's own (a .pth line), so its cupy stays importable
# and the wheel's mpi4py finds the wheel's libmpi. To fetch such wheels elsewhere:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     mpich mpi4py tensorboardX
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl SCALING=0 TESTS=1 OUT_DIR=${OUT:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    --scaling) SCALING=1; shift ;;
    --skip-tests) TESTS=0; shift ;;
    --out) OUT_DIR=$2; shift 2 ;;
    *) echo "usage: $0 [--wheels DIR] [--scaling] [--skip-tests] [--out DIR]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
VENV=${MPIPS_GPU_VENV:-/tmp/mpips-gpu-venv}
# logs, job files and results go straight into --out (a run cut short still leaves them)
LOG=${OUT_DIR:-$(mktemp -d)}
mkdir -p "$LOG" || exit 2
LOG=$(cd "$LOG" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" || exit 2
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$PY" -c 'import site, sys, sysconfig
paths = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")] + site.getsitepackages()
paths.append(site.getusersitepackages())
print("\n".join(dict.fromkeys(p for p in paths if p)))' >"$site/machine-packages.pth" || exit 2
fi
. "$VENV/bin/activate"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  pip install -q --no-index --no-deps --no-compile --ignore-installed "$WHEELS"/*.whl || exit 2
fi
python - <<'EOF' || exit 2
import importlib, sys
missing = []
for name in ("numpy", "h5py", "numba", "scipy", "tqdm", "threadpoolctl", "tensorboardX", "pytest"):
    try:
        importlib.import_module(name)
    except Exception as e:
        missing.append(f"{name} ({type(e).__name__})")
try:
    from mpi4py import MPI
    MPI.Get_library_version()
except Exception as e:
    missing.append(f"an MPI runtime for mpi4py ({e})")
import os
try:
    if os.environ.get("MPIPS_GPU_STANDIN") == "1":
        raise SystemExit  # (the script's own dry run: no GPU)
    import cupy
    print("GPU:", cupy.cuda.runtime.getDeviceCount(), "device(s),",
          cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy", cupy.__version__)
except SystemExit:
    print("no GPU: MPIPS_GPU_STANDIN=1, a dry run of this script on the stand-in")
except Exception as e:
    missing.append(f"cupy with a CUDA device ({e})")
if missing:
    sys.exit("gpu_check: missing " + ", ".join(missing) + " (carry them as wheels: --wheels)")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# NCCL would need one GPU per replica (it refuses two ranks on one device): say if cupy has it
NCCL=$(python -c 'from cupy.cuda import nccl; print("NCCL", nccl.get_version(), "in cupy")' 2>/dev/null || echo "no NCCL in cupy")
echo "$NCCL"
FAILED=0
echo "== the gpu tests"
if [ "$TESTS" = 1 ]; then
  python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py >"$LOG/tests.txt" 2>&1 || FAILED=1
else
  echo "skipped (--skip-tests)" >"$LOG/tests.txt"
fi
tail -5 "$LOG/tests.txt"
echo "== every mode on the GPU (the built-in digits job)"
MODES=""
for spec in "one process:sync:0" "sync:sync:3" "sync_replicas:sync_replicas:3" "async:async:3"; do
  IFS=: read -r label mode ranks <<<"$spec"
  printf '[data]\nbuiltin = "digits"\n[train]\nmode = "%s"\ndevice = "gpu"\nsteps = 300\nprogress = false\n[checkpoint]\ndir = ""\n' "$mode" >"$LOG/$mode.toml"
  launch=(env)
  [ "$ranks" -gt 0 ] && launch=(mpiexec -n "$ranks")
  line=$(cd "$LOG" && timeout 180 "${launch[@]}" python -m mpips train "$mode.toml" 2>&1 | tee "$LOG/$mode-$ranks.log" | grep "final:" | tail -1)
  [ -z "$line" ] && { line="FAILED: $(tail -3 "$LOG/$mode-$ranks.log" | tr '\n' ' ')"; FAILED=1; }
  echo "$label: $line"
  MODES+="$label: ${line#*final: }"$'\n'
done
echo "== the GPU goals"
DRY=--rounds=${GPU_ROUNDS:-2}  # (each round: every configuration twice; GPU_ROUNDS=1 halves it)
[ "${MPIPS_GPU_STANDIN:-}" = 1 ] && DRY=--dry-run
python benchmarks/gpu_workload.py "$DRY" --phases --profile "$LOG/profile.txt" --json "$LOG/gpu.json" 2>&1 | tee "$LOG/goals.txt"
[ "${PIPESTATUS[0]}" = 0 ] || FAILED=1
if [ "$SCALING" = 1 ]; then
  echo "== node scaling (issue 31)"
  python benchmarks/node_scaling.py --budget "${SCALING_BUDGET:-150}" --json "$LOG/node_scaling.json" 2>&1 | tee "$LOG/scaling.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || FAILED=1
fi
echo
echo "================ gpu_check summary ($(date -u +%F), $(git rev-parse --short HEAD 2>/dev/null))"
echo "gpu tests: $(tail -1 "$LOG/tests.txt")"
echo "$NCCL"
printf '%s' "$MODES"
sed -n '/^median of/,$p' "$LOG/goals.txt"
[ "$FAILED" = 0 ] || echo "gpu_check: something FAILED (above)"
exit "$FAILED"

#!/usr/bin/env bash
# Everything that needs a real GPU, in one go: the `cuda` tests, the reproducers,
# the GPU benchmarks and the capture sweep on the real backend. Logs and JSON go
# to $OUT (default reports/gpu); the last lines of each log are the numbers that
# docs/ quotes. Run from the repository root:  OUT=reports/gpu bash benchmarks/run_gpu.sh
set -uo pipefail
OUT=${OUT:-reports/gpu}
mkdir -p "$OUT"
# capsafe as users install it: the wheels under .whl/ (capsafe's own, built from this
# tree with `pip wheel --no-deps -w .whl .`, and any the machine lacks, e.g. platformdirs)
# go into a private site directory; without them, an editable install of the tree.
SITE=${SITE:-$(mktemp -d)}
if compgen -G ".whl/capsafe-*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PATH=$SITE/bin:$PATH
else
    python3 -m pip install -q --no-deps --no-build-isolation -e .
fi
export PYTHONUNBUFFERED=1
export CAPSAFE_KERNEL_CACHE_DIR=${CAPSAFE_KERNEL_CACHE_DIR:-$(mktemp -d)}
PY=${PYTHON:-python3}
failed=()

step() {  # [STEP_TIMEOUT=S] step NAME COMMAND...: run (300 s at most), log to $OUT/NAME.log
    local name=$1; shift
    [[ -z ${STEPS:-} || $name =~ ^(${STEPS})$ ]] || return 0  # STEPS='a|b.*': only those
    echo "=== $name: $*"
    if ! timeout "${STEP_TIMEOUT:-300}" "$@" >"$OUT/$name.log" 2>&1; then failed+=("$name"); fi
    tail -n 4 "$OUT/$name.log"
}

{
    date -u +%Y-%m-%dT%H:%MZ
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    $PY -c 'import sys, cuda.bindings; print("python", sys.version.split()[0], "cuda-bindings", cuda.bindings.__version__)'
    $PY -c 'from capsafe import backend_cuda as b; print("nvrtc", b.nvrtc_version())'
} | tee "$OUT/machine.txt"

export CAPSAFE_BACKEND=${BACKEND:-cuda}  # BACKEND=sim dry-runs this script without a GPU
step cuda_tests $PY -m pytest -m cuda -q -rA -p no:cacheprovider -p no:randomly tests
# --gpus all: each sweep process pinned to one device; the GPUs/rows/devices-seen line is the evidence.
step sweep_gpus $PY -m pytest -m cuda -q -rA -s -p no:cacheprovider -p no:randomly tests/harness/sweep/test_gpus.py
step hazard_matrix $PY -m capsafe_repro.hazard_matrix --backend "$CAPSAFE_BACKEND" --compare --json "$OUT/hazard_matrix.jsonl"
# The same cells with the capture invalidated by another thread's cuCtxSynchronize and left open.
step hazard_matrix_left_open $PY -m capsafe_repro.hazard_matrix --backend "$CAPSAFE_BACKEND" --left-open --compare --json "$OUT/hazard_matrix_left_open.jsonl"
step hazard_matrix_cross_device bash -c 'o=$("$0" -m capsafe_repro.hazard_matrix --backend "$1" --cross-device --compare --json "$2" 2>&1); rc=$?; echo "$o"; [ $rc -eq 0 ] || { [ $rc -eq 2 ] && grep -q "needs 2 devices" <<<"$o"; }' "$PY" "$CAPSAFE_BACKEND" "$OUT/hazard_matrix_cross_device.jsonl"
step capture_race_off $PY -m capsafe_repro.capture_race --backend "$CAPSAFE_BACKEND" --mode global --gate off --threads 4 --seconds 2 --json "$OUT/capture_race_off.json"
step capture_race_on $PY -m capsafe_repro.capture_race --backend "$CAPSAFE_BACKEND" --mode global --gate on --threads 4 --seconds 2 --json "$OUT/capture_race_on.json"
# Gate on, every capture-breaking action of capsafe.hazards.actions, each capture mode: >= 10,000 captures each, 0 invalidated.
step capture_race_hazards_global $PY -m capsafe_repro.capture_race --backend "$CAPSAFE_BACKEND" --mode global --gate on --threads 4 --seconds 6 --hazards --json "$OUT/capture_race_hazards_global.json"
step capture_race_hazards_thread_local $PY -m capsafe_repro.capture_race --backend "$CAPSAFE_BACKEND" --mode thread_local --gate on --threads 4 --seconds 6 --hazards --json "$OUT/capture_race_hazards_thread_local.json"
step capture_race_hazards_relaxed $PY -m capsafe_repro.capture_race --backend "$CAPSAFE_BACKEND" --mode relaxed --gate on --threads 4 --seconds 6 --hazards --json "$OUT/capture_race_hazards_relaxed.json"
step default_stream_race $PY -m capsafe_repro.default_stream_race --backend "$CAPSAFE_BACKEND" --json "$OUT/default_stream_race.json"
step frozen_config $PY -m capsafe_repro.frozen_config --backend "$CAPSAFE_BACKEND" --json "$OUT/frozen_config.json"
step context_warmup $PY -m capsafe_repro.context_warmup --backend "$CAPSAFE_BACKEND" --json "$OUT/context_warmup.json"
step bench_gate $PY benchmarks/gate.py
step bench_kernel_cache_gpu $PY benchmarks/kernel_cache_gpu.py
# The capture suite holds a planted failure, so this sweep's own exit code is 1 when it works.
step sweep_capture bash -c 'capsafe sweep repro/suites/capture --runs 2 --workers 2 --seed 3 \
    --isolation-runs 2 --neighbors 2 --timeout 20 --no-progress --out "$0/sweep_capture"; [ $? -le 1 ]' "$OUT"

# CuPy 14.2's own graph and stream tests (the lead copies them to .gpu/): one plain pytest
# run, the sweep with and without --neighbors 2; the last line is the wall-time ratio.
step cupy_sweep $PY benchmarks/cupy_sweep.py --suite .gpu/cupy-v14.2.0 --out "$OUT/cupy_sweep"
# The wider slice (issue 20): five more of CuPy's cuda_tests files beside the two, memory and
# pool tests among them, copied from the tag (`git show v14.2.0:tests/cupy_tests/cuda_tests/F`);
# --neighbors 2 only. test_thread_safe waits forever for a second GPU on a one-GPU host.
slice=(graph stream memory device driver runtime pinned_memory)
slice=("${slice[@]/#/tests/cupy_tests/cuda_tests/test_}")
STEP_TIMEOUT=530 step cupy_more $PY benchmarks/cupy_sweep.py --suite .gpu/cupy-v14.2.0 \
    --out "$OUT/cupy_more" --neighbors-only --timeout 20 --sweep-limit 450 --limit 100 --jobs 6 \
    --deselect tests/cupy_tests/cuda_tests/test_device.py::TestDeviceSwitch::test_thread_safe \
    --files "${slice[@]/%/.py}"
# Integrations (docs/integrations.md): CuPy's own graph and stream tests (.gpu/cupy-v14.2.0) and
# the cuda_core_capture suite, without and with --capsafe-protect. `same` steps: without
# neighbours the outcomes must be identical with and without capsafe; `protect` steps: every
# test the unprotected sweep classifies capture-unsafe must pass in the protected one.
step bench_integrations $PY benchmarks/integrations.py
step bench_torch_protect $PY benchmarks/torch_protect.py
# The torch.cuda.graph suite (a capture in each mode, issue 20): the sweep with and without
# neighbours (its checks and cost ratio as for CuPy), the neighbour sweep again with
# --capsafe-protect=torch (every capture-unsafe test must pass), and without neighbours the
# same outcomes with and without the protection.
step torch_sweep $PY benchmarks/cupy_sweep.py --suite benchmarks/torch_graph_suite \
    --files test_torch_graph.py --out "$OUT/torch_sweep"
step torch_sweep_protected bash -c 'cd benchmarks/torch_graph_suite && capsafe sweep test_torch_graph.py \
    --runs 3 --workers 2 --seed 11 --neighbors 2 --no-progress --force --out "$0/torch_sweep_protected" \
    -- --capsafe-protect=torch' "$(realpath "$OUT")"
step protect_torch $PY -m capsafe_harness.report.protection "$OUT/torch_sweep/cupy_sweep_neighbors" "$OUT/torch_sweep_protected"
step torch_same bash -c 'cd benchmarks/torch_graph_suite && o() { $0 -m pytest test_torch_graph.py -q -rA "$@" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) " | cut -d" " -f1-2 | sort; }; a=$(o -p no:capsafe); b=$(o --capsafe-protect=torch); diff <(echo "$a") <(echo "$b") && echo "identical outcomes without capsafe and with --capsafe-protect=torch: $(echo "$a" | wc -l) tests"' "$PY"
step cupy_same bash -c 'cd .gpu/cupy-v14.2.0 && o() { $0 -m pytest tests/cupy_tests/cuda_tests/test_graph.py tests/cupy_tests/cuda_tests/test_stream.py -q -rA -p no:cacheprovider "$@" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) " | cut -d" " -f1-2 | sort; }; a=$(o -p no:capsafe); b=$(o --capsafe-protect=cupy); diff <(echo "$a") <(echo "$b") && echo "identical outcomes without capsafe and with --capsafe-protect=cupy: $(echo "$a" | wc -l) tests"' "$PY"
step sweep_cupy_graph bash -c 'capsafe sweep .gpu/cupy-v14.2.0/tests/cupy_tests/cuda_tests/test_graph.py --runs 2 --workers 2 --seed 3 --isolation-runs 2 --neighbors 2 --timeout 60 --no-progress --protect cupy --out "$0/sweep_cupy_graph"; r=$?; "$1" -m capsafe_harness.report.protection "$0/sweep_cupy_graph"; [ $r -le 1 ]' "$OUT" "$PY"
step sweep_cupy_graph_protected bash -c 'capsafe sweep .gpu/cupy-v14.2.0/tests/cupy_tests/cuda_tests/test_graph.py --runs 2 --workers 2 --seed 3 --isolation-runs 2 --neighbors 2 --timeout 60 --no-progress --out "$0/sweep_cupy_graph_protected" -- --capsafe-protect=cupy; [ $? -le 1 ]' "$OUT"
step protect_cupy $PY -m capsafe_harness.report.protection "$OUT/sweep_cupy_graph" "$OUT/sweep_cupy_graph_protected"
step cuda_core_same bash -c 'o() { $0 -m pytest repro/suites/cuda_core_capture -q -rA -p no:cacheprovider "$@" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) " | cut -d" " -f1-2 | sort; }; a=$(o -p no:capsafe); b=$(o --capsafe-protect=cuda_core); diff <(echo "$a") <(echo "$b") && echo "identical outcomes without capsafe and with --capsafe-protect=cuda_core: $(echo "$a" | wc -l) tests"' "$PY"
step sweep_cuda_core bash -c 'capsafe sweep repro/suites/cuda_core_capture --runs 2 --workers 2 --seed 3 --isolation-runs 2 --neighbors 2 --timeout 30 --no-progress --out "$0/sweep_cuda_core"; [ $? -le 1 ]' "$OUT"
step sweep_cuda_core_protected capsafe sweep repro/suites/cuda_core_capture --runs 2 --workers 2 --seed 3 --isolation-runs 2 --neighbors 2 --timeout 30 --no-progress --out "$OUT/sweep_cuda_core_protected" -- --capsafe-protect=cuda_core
step protect_cuda_core $PY -m capsafe_harness.report.protection "$OUT/sweep_cuda_core" "$OUT/sweep_cuda_core_protected"

echo "failed steps: ${failed[*]:-none}" | tee "$OUT/failed.txt"
[ ${#failed[@]} -eq 0 ]

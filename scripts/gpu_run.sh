#!/usr/bin/env bash
# The one prepared run on a GPU node (one H200-class GPU; torch with CUDA and Python 3.12 there, no network needed):
#
#   bash scripts/gpu_run.sh --dry-run     # anywhere, on CPU: print every step in order, check budget and imports
#   bash scripts/gpu_run.sh               # on the GPU node: everything within 9 minutes, essentials first
#   bash scripts/gpu_run.sh --compile     # on the GPU node, a second call: the DiT under off / blocks / graphs
#
# It installs the wheels in .whl/ (git-ignored; docs/gpus.md says how to fill it) into a temporary directory, puts
# that on PYTHONPATH, times the machine's cold `import torch` under its own budget (with the C compiler triton needs),
# checks every third-party module the run imports, then runs each benchmark section as its own process under
# `timeout`, essentials first: the attention table, the GEMM floor, the DiT steady chunk eager, the DiT compiled
# (`compile = blocks`, compile time apart), one split7 DiT rank's compute, the VAE per precision, the served session (its server log kept). Then
# the extras, each only if it still fits in LIMIT_S. A hang in one step cannot lose the others: every step writes its
# JSON as it ends. Everything lands in one folder: $OUT when set, else out/gpu_run/:
#   bench_gpu.json      every section's numbers (probe, sdpa, matmul, dit, vae, serve, ...)
#   bench_compile.json  the compiled DiT per mode     server.log   the served session's server, INFO lines
#   run.log             every command's output        steps.tsv    step, exit code, seconds, budget
#   summary.txt         the table to copy into a report
# Environment: PYTHON (default python3, the machine's torch interpreter), WHEELS (default .whl).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
DRY=0
PLAN=plan
SCALE=1  # --scale=N: every budget N times longer (the CPU rehearsal of tests/test_gpu_run.py on a shared machine)
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        --compile) PLAN=compile_plan ;;
        --scale=*) SCALE=${arg#--scale=} ;;
        *) echo "usage: bash scripts/gpu_run.sh [--dry-run] [--compile] [--scale=N]" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
OUT_DIR=${OUT:-out/gpu_run}
JSON=$OUT_DIR/bench_gpu.json
LOG=$OUT_DIR/run.log
LIMIT_S=540  # 9 minutes on one H200 from a cold start: every essential step's budget and its kill grace counted
[[ $PLAN == compile_plan ]] && LIMIT_S=350  # the second call: probe, check and the three compile modes
[[ $SCALE =~ ^[1-9][0-9]*$ ]] || { echo "--scale takes a whole number >= 1, not $SCALE" >&2; exit 2; }
GRACE_S=5    # after a step's budget: SIGTERM (the bench records the section as timed out), then SIGKILL
ENTRIES=(scripts/bench_gpu.py launch.py scripts/bench_compile.py scripts/gpu_probe.py)  # what the runs execute
NOT_NEEDED=(prometheus_client)            # imported only with [metrics] port set, which this run does not set

# The device image's Python packages (KINDS.md, "Python packages already there", read 2026-11-17). Anything
# else must come as a wheel in .whl/.
DEVICE_PACKAGES="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"

BENCH=("$PY" scripts/bench_gpu.py --merge --out "$JSON")

# The plan: one `step NAME BUDGET_S COMMAND...` per process, in order of what the run must not lose; `extra` steps
# follow and run only while the time spent so far plus their budget stays within LIMIT_S. To add a section, add a
# line here and its script to ENTRIES (so the import check covers it); keep the essentials within LIMIT_S (the dry run
# checks), and merge into $JSON or write one file rather than many.
plan() {
    step sdpa 20 "${BENCH[@]}" --only sdpa                 # the attention table at the real shapes
    step matmul 15 "${BENCH[@]}" --only matmul --only kv_cache  # the bf16 GEMM rate: the DiT's floor
    step dit 80 "${BENCH[@]}" --only dit                   # v1 and v2 steady chunk, eager
    # compile = blocks: six cold compiles of one block, the window's fill, two steady chunks (compile time apart)
    step compile_blocks 95 "$PY" scripts/bench_compile.py --modes blocks --chunks 2 --out "$OUT_DIR/bench_compile.json"
    # one split7 DiT rank's own work (8 heads, its token shard and KV share; SP = 8 too), all-to-alls stood in for
    step split_rank 25 "${BENCH[@]}" --only split_rank
    step vae 55 "${BENCH[@]}" --only vae
    # serve: EAGER module loading, random init of the 14B DiT and umT5-XXL, attention timing, pricing every size,
    # the warm-up at one size (a session per stage thread) and then 8 chunks of a served session; server.log kept
    step serve 140 "${BENCH[@]}" --only serve
    extra umt5 25 "${BENCH[@]}" --only umt5
    extra dit_bf16 15 "${BENCH[@]}" --only dit_bf16_vs_fp32
}

# The second call: v1 at 480x832 through the window's fill (every compile and capture happens there) and two steady
# chunks, per mode; eager is measured again beside them so the ratios come from one process. --warm-cache: graphs
# reuses the kernels blocks compiled (its compile time is then capture time); each mode's line is in run.log as soon
# as it finishes, so a timeout in graphs keeps off and blocks.
compile_plan() {
    step compile 250 "$PY" scripts/bench_compile.py --chunks 2 --warm-cache --out "$OUT_DIR/bench_compile.json"
}

TOTAL_S=0
STARTED=$SECONDS
# run one step under its budget; its row goes to steps.tsv as it ends (the JSON it wrote is already on disk)
run_step() {
    local name=$1 budget=$(($2 * SCALE))
    shift 2
    echo "# step $name (budget $budget s): $*" | tee -a "$LOG"
    local began=$SECONDS
    timeout -k "$GRACE_S" "$budget" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - began))
    [[ $rc == 124 || $rc == 137 ]] && echo "# step $name TIMED OUT after $took s (budget $budget s)" | tee -a "$LOG"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$budget" >>"$OUT_DIR/steps.tsv"
}
step() {  # an essential step: counted in the budget the dry run checks
    local name=$1 budget=$2
    TOTAL_S=$((TOTAL_S + budget + GRACE_S))
    if ((RUNNING == 0)); then
        shift 2
        printf '+ [%s, %s s] timeout -k %s %s %s\n' "$name" "$budget" "$GRACE_S" "$budget" "$*"
        return 0
    fi
    run_step "$@"
}
extra() {  # after the essentials: runs only if it still fits within LIMIT_S from the run's start
    local name=$1 budget=$2
    if ((RUNNING == 0)); then
        shift 2
        printf '+ [%s, %s s, if it fits] timeout -k %s %s %s\n' "$name" "$budget" "$GRACE_S" "$budget" "$*"
        return 0
    fi
    local left=$(((LIMIT_S - SUMMARY_S) * SCALE - (SECONDS - STARTED)))
    if ((budget * SCALE + GRACE_S > left)); then
        echo "# step $name skipped: $left s left, it needs $((budget * SCALE + GRACE_S))" | tee -a "$LOG"
        printf '%s\tskipped\t0\t%s\n' "$name" "$budget" >>"$OUT_DIR/steps.tsv"
        return 0
    fi
    run_step "$@"
}

INSTALL_S=15
PROBE_S=30   # the machine's first `import torch` (GBs of CUDA libraries from a cold page cache) and CUDA context
CHECK_S=20   # imports everything else; torch is warm by then
SUMMARY_S=5  # reads one JSON and prints
PROBE=("$PY" scripts/gpu_probe.py --out "$JSON")
RUNNING=0
echo "+ [install, $INSTALL_S s] $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade" \
    "--target \$SITE $WHEELS/*.whl; export PYTHONPATH=\$SITE:$ROOT"
step probe "$PROBE_S" "${PROBE[@]}"
echo "+ [check, $CHECK_S s] $PY scripts/gpu_deps.py --importable ${ENTRIES[*]}"
$PLAN
SUMMARY=("$PY" scripts/bench_gpu.py --summary --out "$JSON")
# the compile run's summary is bench_compile.py's closing table, cut from the log
[[ $PLAN == compile_plan ]] && SUMMARY=(sed -n '/^mode /,$p' "$LOG")
echo "+ [summary, $SUMMARY_S s] ${SUMMARY[*]}"
TOTAL_S=$((TOTAL_S + INSTALL_S + CHECK_S + SUMMARY_S))
echo "budget: $TOTAL_S s of $LIMIT_S s"
if ((TOTAL_S > LIMIT_S)); then
    echo "the steps' budgets add up to $TOTAL_S s, over the $LIMIT_S s the run may take: shorten them" >&2
    exit 1
fi
NOT_NEEDED_ARGS=()
for module in "${NOT_NEEDED[@]}"; do NOT_NEEDED_ARGS+=(--not-needed "$module"); done

if ((DRY)); then
    echo "checking the run's imports against the device image and $WHEELS/:"
    "$PY" scripts/gpu_deps.py --wheels "$WHEELS" --device-packages "$DEVICE_PACKAGES" "${NOT_NEEDED_ARGS[@]}" \
        "${ENTRIES[@]}"
    exit $?
fi

mkdir -p "$OUT_DIR"
: >"$LOG"
printf 'step\trc\tseconds\tbudget_s\n' >"$OUT_DIR/steps.tsv"
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1; } | tee -a "$LOG"
SITE=$(mktemp -d /tmp/gpu_run_site.XXXXXX)
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if ((${#wheels[@]})); then
    timeout $((INSTALL_S * SCALE)) "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}" 2>&1 | tee -a "$LOG" || { echo "installing $WHEELS/*.whl failed" >&2; exit 1; }
else
    echo "no wheels in $WHEELS/: using the interpreter's own packages" | tee -a "$LOG"
fi
export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
RUNNING=1
STARTED=$SECONDS
# the cold import first, under its own budget and never fatal: a slow one only delays, and `check` then finds it warm
run_step probe "$PROBE_S" "${PROBE[@]}"
timeout $((CHECK_S * SCALE)) "$PY" scripts/gpu_deps.py --importable "${NOT_NEEDED_ARGS[@]}" "${ENTRIES[@]}" 2>&1 | tee -a "$LOG"
check_rc=${PIPESTATUS[0]}
# a module that does not import ends the run (nothing could be measured); a slow check only costs its budget, since
# every step imports what it needs under its own timeout and says so if it cannot
if ((check_rc == 124 || check_rc == 137)); then
    echo "# check TIMED OUT after $CHECK_S s: going on, each step reports its own import errors" | tee -a "$LOG"
elif ((check_rc != 0)); then
    echo "a module the run needs does not import: see above" >&2
    exit 1
fi
$PLAN
timeout $((SUMMARY_S * SCALE)) "${SUMMARY[@]}" 2>&1 | tee "$OUT_DIR/summary.txt"
if [[ $PLAN == plan ]]; then  # the compiled DiT's table, from its step's output
    { echo; sed -n '/^mode /,/^wrote /p' "$LOG"; } | tee -a "$OUT_DIR/summary.txt"
fi
{ echo; echo "steps (exit code 124/137: timed out):"; cat "$OUT_DIR/steps.tsv"; } | tee -a "$OUT_DIR/summary.txt"
rm -rf "$SITE"
# the run succeeded when every step did
awk -F'\t' 'NR > 1 && $2 != 0 && $2 != "skipped" { failed = 1 } END { exit failed }' "$OUT_DIR/steps.tsv"

#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (one H200; torch 2.11 + Python 3.12 there, no network, no make):
#
#   bash scripts/gpu_run.sh --dry-run     # here, on CPU: print every command, check the imports can be satisfied
#   bash scripts/gpu_run.sh               # there (device tool: carry [".whl"], timeout_s 540)
#   bash scripts/gpu_run.sh --compile     # there, a second call if device time is left: the DiT compiled
#                                         # (model.compile off / blocks / graphs, issue 23), within 5 minutes
#
# It installs the wheels carried in .whl/ (git-ignored; the README's GPU section says how to fill it) into a
# temporary directory, puts that on PYTHONPATH, checks every third-party module the run imports, then runs each
# benchmark section as its own process under `timeout` (a hang in one cannot lose the others: each merges its
# section into one JSON as soon as it finishes), then a served session, then prints the summary table. Everything
# lands in one folder: $OUT when set (the device tool returns it: at most 8 files), else out/gpu_run/:
#   bench_gpu.json  every section's numbers     run.log      every command's output
#   steps.tsv       step, exit code, seconds    summary.txt  the table to copy into the closing note
# Environment: PYTHON (default python3, the machine's torch interpreter), WHEELS (default .whl).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
DRY=0
PLAN=plan
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        --compile) PLAN=compile_plan ;;
        *) echo "usage: bash scripts/gpu_run.sh [--dry-run] [--compile]" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
OUT_DIR=${OUT:-out/gpu_run}
JSON=$OUT_DIR/bench_gpu.json
LOG=$OUT_DIR/run.log
LIMIT_S=480  # 8 minutes on one H200, every step's budget and its kill grace counted
[[ $PLAN == compile_plan ]] && LIMIT_S=300  # the second call: what 15 device minutes leave after the first
GRACE_S=5    # after a step's budget: SIGTERM (the bench records the section as timed out), then SIGKILL
ENTRIES=(scripts/bench_gpu.py launch.py scripts/bench_compile.py)  # what the runs execute (launch.py: the server)
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

# The plan: one `step NAME BUDGET_S COMMAND...` per process, in order. To add a section, add a line here and its
# script to ENTRIES (so the import check covers it); keep the total within LIMIT_S (the dry run checks), and since the
# device returns at most 8 files from $OUT, merge into $JSON or write one file rather than many.
plan() {
    step matmul 15 "${BENCH[@]}" --only matmul --only kv_cache
    step sdpa 20 "${BENCH[@]}" --only sdpa
    step dit 90 "${BENCH[@]}" --only dit
    step vae 60 "${BENCH[@]}" --only vae
    step umt5 25 "${BENCH[@]}" --only umt5
    step dit_bf16 15 "${BENCH[@]}" --only dit_bf16_vs_fp32
    # serve: EAGER module loading, random init of the 14B DiT and umT5-XXL, attention timing, pricing every size,
    # the warm-up at one size (a session per stage thread) and then 8 chunks of a served session
    step serve 175 "${BENCH[@]}" --only serve
}

# The second call: v1 at 480x832 through the window's fill (every compile and capture happens there) and two steady
# chunks, per mode; eager is measured again beside them so the ratios come from one process. --warm-cache: graphs
# reuses the kernels blocks compiled (its compile time is then capture time); each mode's line is in run.log as soon
# as it finishes, so a timeout in graphs keeps off and blocks.
compile_plan() {
    step compile 250 "$PY" scripts/bench_compile.py --chunks 2 --warm-cache --out "$OUT_DIR/bench_compile.json"
}

TOTAL_S=0
step() {
    local name=$1 budget=$2
    shift 2
    TOTAL_S=$((TOTAL_S + budget + GRACE_S))
    if ((RUNNING == 0)); then
        printf '+ [%s, %s s] timeout -k %s %s %s\n' "$name" "$budget" "$GRACE_S" "$budget" "$*"
        return 0
    fi
    echo "# step $name (budget $budget s): $*" | tee -a "$LOG"
    local began=$SECONDS
    timeout -k "$GRACE_S" "$budget" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - began))
    [[ $rc == 124 || $rc == 137 ]] && echo "# step $name TIMED OUT after $took s (budget $budget s)" | tee -a "$LOG"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$budget" >>"$OUT_DIR/steps.tsv"
}

INSTALL_S=15
CHECK_S=20
SUMMARY_S=10
RUNNING=0
echo "+ [install, $INSTALL_S s] $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade" \
    "--target \$SITE $WHEELS/*.whl; export PYTHONPATH=\$SITE:$ROOT"
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
    timeout "$INSTALL_S" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}" 2>&1 | tee -a "$LOG" || { echo "installing $WHEELS/*.whl failed" >&2; exit 1; }
else
    echo "no wheels in $WHEELS/: using the interpreter's own packages" | tee -a "$LOG"
fi
export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
timeout "$CHECK_S" "$PY" scripts/gpu_deps.py --importable "${NOT_NEEDED_ARGS[@]}" "${ENTRIES[@]}" 2>&1 \
    | tee -a "$LOG" || { echo "a module the run needs does not import: see above" >&2; exit 1; }
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' \
    2>&1 | tee -a "$LOG"
RUNNING=1
$PLAN
timeout "$SUMMARY_S" "${SUMMARY[@]}" 2>&1 | tee "$OUT_DIR/summary.txt"
{ echo; echo "steps (exit code 124/137: timed out):"; cat "$OUT_DIR/steps.tsv"; } | tee -a "$OUT_DIR/summary.txt"
rm -rf "$SITE"
# the run succeeded when every step did
awk -F'\t' 'NR > 1 && $2 != 0 { failed = 1 } END { exit failed }' "$OUT_DIR/steps.tsv"

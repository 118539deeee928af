#!/usr/bin/env bash
# Runs the GPU tier (pytest -m gpu) and `aotdist bench --device cuda` on a GPU machine that
# has torch 2.11, torchvision, accelerate, lightning, pytest, pyyaml, matplotlib and
# transformers but not aotdist's other dependencies, and no package registry.
#
#     scripts/gpu_wheels.sh      # first, on a machine with a registry (fills .gpu-wheels/)
#     scripts/gpu_tier.sh        # then, on the GPU machine, from the checkout
#     scripts/gpu_tier.sh --dry-run   # print the commands, check wheels and imports only
#     scripts/gpu_tier.sh --short     # fits a 10-minute lease (below)
#
# --short: each GPU test in its own pytest run (a killed run still leaves the tracebacks of
# the tests before it), at most $SHORT_TEST_S seconds each (default 75); then
# scripts/gpu_probe.py (step times side by side, with and without CUDA graphs) and the
# bench's GPT at depth 32 with full, accelerate and aotdist, one repeat; each part
# time-boxed (130 s probe, 150 s bench; on one H100 the tests took about 40 s each, so
# the whole run is about 9 minutes). Logs and JSON go to $BENCH_OUT. To fit a smaller
# lease: SHORT_K (a pytest -k expression choosing the tests), PROBE_ARGS (the probe's
# arguments), PROBE_S (its time box) and SKIP_BENCH=1 (no bench); BENCH_MODE (e.g.
# reduce-overhead) is the bench's --mode.
#
# The wheels are installed with --no-index --no-deps into $GPU_SITE (default /tmp/site),
# outside any environment, and reach Python through PYTHONPATH together with the checkout
# (aotdist is not installed: it is imported from here, and the bench's fresh processes
# and the test ranks inherit PYTHONPATH). Results: pytest's output, and the bench report
# in $BENCH_OUT (default bench-out-cuda/). Exit status: pytest's, else the bench's.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
SITE="${GPU_SITE:-/tmp/site}"
WHEELS="${GPU_WHEELS_DIR:-$ROOT/.gpu-wheels}"
BENCH_OUT="${BENCH_OUT:-bench-out-cuda}"
DRY=0
SHORT=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
[[ "${1:-}" == "--short" ]] && SHORT=1

run() {
    echo "+ $*"
    [[ $DRY == 1 ]] || "$@"
}

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [[ ${#wheels[@]} -eq 0 ]]; then
    echo "no wheels in $WHEELS. Fix: run scripts/gpu_wheels.sh on a machine with a package" \
         "registry and bring .gpu-wheels/ along with the checkout." >&2
    exit 2
fi

cd "$ROOT"
run "$PY" -m pip install --no-index --no-deps --target "$SITE" --upgrade "${wheels[@]}" || exit $?
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
echo "+ export PYTHONPATH=$PYTHONPATH"

# What the tier needs, importable (torchao and jsonargparse from the wheels when installed).
missing=$("$PY" - <<'PY'
import importlib.util
need = ["torch", "torchvision", "accelerate", "lightning", "pytest", "pytest_timeout", "yaml",
        "matplotlib", "torchao", "jsonargparse", "aotdist"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
if [[ -n "$missing" && $DRY == 0 ]]; then
    echo "not importable: $missing (PYTHONPATH=$PYTHONPATH)" >&2
    exit 2
elif [[ -n "$missing" ]]; then
    echo "(dry run) not importable yet: $missing"
fi

ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
echo "torch $("$PY" -c 'import torch; print(torch.__version__)'), CUDA devices: $ngpu"
if [[ "$ngpu" -lt 1 && $DRY == 0 ]]; then
    echo "no CUDA device visible: the GPU tier would only skip. Run it on a GPU machine." >&2
    exit 2
fi

if [[ $SHORT == 1 ]]; then
    mkdir -p "$BENCH_OUT"
    status=0
    tests=$("$PY" -m pytest -p no:cacheprovider -m gpu --collect-only -q ${SHORT_K:+-k "$SHORT_K"} \
        tests/gpu | grep '::')
    for t in $tests; do
        echo "+ timeout ${SHORT_TEST_S:-75} $PY -m pytest -m gpu --tb=short $t"
        timeout "${SHORT_TEST_S:-75}" "$PY" -m pytest -p no:cacheprovider -m gpu -q -rs \
            --tb=short "$t" >>"$BENCH_OUT/pytest.log" 2>&1
        rc=$?
        echo "  exit $rc"
        [[ $rc -ne 0 ]] && status=$rc
    done
    grep -E "^(FAILED|ERROR|E  )" "$BENCH_OUT/pytest.log" | head -40
    # shellcheck disable=SC2086  # PROBE_ARGS is a list of arguments
    run timeout "${PROBE_S:-130}" "$PY" scripts/gpu_probe.py ${PROBE_ARGS:-} \
        --out "$BENCH_OUT/probe.json"
    [[ -n "${SKIP_BENCH:-}" ]] && exit $status
    run timeout 150 "$PY" -m aotdist.cli bench --device cuda --model gpt --depths 32 \
        --strategies full,accelerate,aotdist --repeats 1 ${BENCH_MODE:+--compile-mode "$BENCH_MODE"} \
        --out "$BENCH_OUT"
    exit $status
fi

run "$PY" -m pytest -p no:cacheprovider -m gpu -v -rs tests/gpu
status=$?

# The bench's main job (one process per cell, one GPU) needs transformers for its Llama;
# without it, the GPT models of the main job at depths 2, 8 and 32.
if "$PY" -c "import transformers" 2>/dev/null; then
    run "$PY" -m aotdist.cli bench --device cuda --out "$BENCH_OUT"
else
    echo "transformers is not importable: benching gpt and dictgpt only (no Llama)"
    run "$PY" -m aotdist.cli bench --device cuda --model gpt,dictgpt --depths 2,8,32 \
        --out "$BENCH_OUT"
fi
bench=$?
[[ $status -ne 0 ]] && exit $status
exit $bench

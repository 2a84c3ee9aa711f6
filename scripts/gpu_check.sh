#!/usr/bin/env bash
# GPU check on a 1-GPU machine without network: every gpu-marked test, then the GPU benchmark
# (eager and CUDA graphs). Installs nothing: the repository is put on PYTHONPATH (torch,
# triton, transformers, safetensors, pytest must already be there; textual/platformdirs are
# not needed). Target: under 8 minutes on an H100/H200.
#
#   scripts/gpu_check.sh              # tests + benchmarks
#   SKIP_BENCH=1 scripts/gpu_check.sh # tests only
#   BENCH_ARGS="--num-seqs 64" scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
LOG_DIR="$(mktemp -d -t tinyvllm-gpu-check.XXXXXX)"
START=$SECONDS
status=0

python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(0), 'torch', torch.__version__, end=' '); \
import triton; print('triton', triton.__version__)" || exit 1

echo "== pytest -m gpu"
timeout 180 python -m pytest -q -m gpu -o addopts="" -p no:cacheprovider tests \
    2>&1 | tee "$LOG_DIR/pytest.log"
test_rc=${PIPESTATUS[0]}
[ "$test_rc" -eq 5 ] && test_rc=0  # no GPU tests collected
[ "$test_rc" -ne 0 ] && status=1
TEST_SUMMARY="$(tail -n 1 "$LOG_DIR/pytest.log")"

BENCH_LINES=()
if [ -z "${SKIP_BENCH:-}" ]; then
    MODEL_DIR="$LOG_DIR/qwen3-0.6b-random"  # built once, shared by both runs
    for mode in eager graphs; do
        echo "== benchmarks/gpu_bench.py ($mode)"
        flags=(--model-dir "$MODEL_DIR")
        if [ "$mode" = eager ]; then flags+=(--enforce-eager --hf); fi
        # shellcheck disable=SC2086
        timeout 140 python benchmarks/gpu_bench.py "${flags[@]}" ${BENCH_ARGS:-} \
            2>&1 | tee "$LOG_DIR/bench-$mode.log"
        rc=${PIPESTATUS[0]}
        line="$(grep '^RESULT ' "$LOG_DIR/bench-$mode.log" | tail -n 1)"
        if [ "$rc" -ne 0 ] || [ -z "$line" ]; then
            status=1
            line="RESULT mode=$mode FAILED (exit $rc, see $LOG_DIR/bench-$mode.log)"
        fi
        BENCH_LINES+=("$line")
    done
    rm -rf "$MODEL_DIR"
fi

echo
echo "== summary ($((SECONDS - START))s, logs in $LOG_DIR)"
echo "tests: $TEST_SUMMARY"
for line in "${BENCH_LINES[@]}"; do echo "bench: ${line#RESULT }"; done
[ "$status" -eq 0 ] && echo "GPU CHECK PASSED" || echo "GPU CHECK FAILED"
exit "$status"

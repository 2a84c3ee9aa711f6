#!/usr/bin/env bash
# GPU check: the GPU-marked tests and the throughput benchmark on a CUDA machine.
# Run from the repository root on a machine with an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(0), torch.__version__)"
python -m pip install --quiet -e ".[dev]"
python -m pytest -q -m gpu -o addopts="" || [ $? -eq 5 ]   # exit 5: no GPU tests collected yet
python benchmarks/throughput.py --workloads a,b,c --skip-hf-mix

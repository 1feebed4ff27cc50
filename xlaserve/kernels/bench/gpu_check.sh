#!/usr/bin/env bash
cd "$(dirname "$0")/../../.." && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m xlaserve.kernels.bench.gpu_check "$@"

#!/usr/bin/env bash
# The GPU check of issue 53 (DSpark in vLLM), for a session lent a GPU: vLLM 0.32 runs DSpark only in its V2
# model runner, which needs Triton with a backend (CUDA), so on CPU machines these tests are skipped.
#   bash bench/gpu_dspark.sh            (from the repository root, after the test install)
set -u
python bench/gpu_check.py
python -m pytest -q -rs tests/engine/test_vllm_dspark.py tests/engine/test_dspark_heads.py

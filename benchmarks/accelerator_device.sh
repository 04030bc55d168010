#!/usr/bin/env bash
# The accelerator benchmark on a lent GPU machine (stock CUDA image: jax, flax, optax, torch, transformers are
# there; pydantic, zstandard and the signing libraries are not, so they travel as wheels in the ignored folder
# .whl/).
#
#   here, once:        bash benchmarks/accelerator_device.sh fetch
#                      (downloads this venv's versions of WHEELS for CPython 3.12 x86-64 into .whl/, ignored)
#   on the machine:    bash benchmarks/accelerator_device.sh      (the device tool: carry [".whl"], timeout 560)
#
# It installs the wheels into /tmp/site, prints `intellect doctor`, then runs benchmarks/accelerator.py with a
# 440 s stage budget inside a 470 s limit (under 8 minutes in all), tee'ing the JSON lines and the final JSON
# to $OUT (the device tool's output folder; runs/accelerator here).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(pydantic pydantic-core annotated-types typing-inspection pydantic-settings python-dotenv zstandard
    cryptography cffi pycparser pynacl)

if [ "${1:-}" = fetch ]; then
    grep -qxF '/.whl/' .git/info/exclude || echo '/.whl/' >>.git/info/exclude
    for name in "${WHEELS[@]}"; do
        version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))") || exit 1
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "$name==$version" || exit 1
    done
    ls .whl
    exit 0
fi

OUT=${OUT:-runs/accelerator}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
fi
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 60 python3 -m intellect doctor --timeout 45 2>&1 | tee "$OUT/doctor.txt"
timeout 470 python3 benchmarks/accelerator.py --budget 440 --out "$OUT/accelerator.jsonl" | tee "$OUT/accelerator.json"

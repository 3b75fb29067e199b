#!/usr/bin/env bash
# The GPU run of issue 16 in one command: the optimizer steps at 100M parameters (one
# leaf and 200 leaves) and the whole training step, JAX on the GPU and torch on CUDA, each
# row against the in-place bandwidth ceiling measured in the same run. For a machine with
# a CUDA GPU whose Python has jax with its CUDA plugin, optax, chex and torch installed;
# functorch_optim is taken from this checkout (no build: its CPU kernels are not used on
# a GPU). From the repository's root:
#
#     bash benchmarks/gpu.sh [OUTPUT_DIR]
#
# writes gpu.json and gpu.md (and one JSON per part) to OUTPUT_DIR (default
# benchmarks/results/gpu). PYTHON picks the interpreter (default python3); SIZES, REPS
# and COMPILE_ROUNDS override the sizes, the timed reps and the whole step's cold
# compiles; PARTS (default "steps train merge") runs some parts only, e.g. one per call
# where a call's time is limited (merge reads the JSON the other two left in
# OUTPUT_DIR); ALLOW_CPU=1 runs it where JAX has no GPU (a dry run of the script).
set -euo pipefail
out=${1:-benchmarks/results/gpu}
py=${PYTHON:-python3}
sizes=${SIZES:-1e8x1 1e8x200}
reps=${REPS:-9}
rounds=${COMPILE_ROUNDS:-1}
parts=" ${PARTS:-steps train merge} "
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# JAX would take 75% of the GPU's memory at start, torch's contenders share the device
export XLA_PYTHON_CLIENT_PREALLOCATE=false
"$py" - <<'PY'
import os, jax
backend = jax.default_backend()
print("jax", jax.__version__, backend, jax.devices())
if backend != "gpu" and os.environ.get("ALLOW_CPU") != "1":
    raise SystemExit(f"JAX runs on {backend}, not a GPU (ALLOW_CPU=1 runs it anyway)")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
if [[ $parts == *" steps "* ]]; then
  # shellcheck disable=SC2086  # the sizes are separate arguments
  "$py" -m functorch_optim bench --sections sgd adam adamw adagrad --sizes $sizes \
    --reps "$reps" --json "$out/steps.json" --no-plot --note "benchmarks/gpu.sh"
fi
if [[ $parts == *" train "* ]]; then
  "$py" -m functorch_optim bench --sections train --reps "$reps" --compile-rounds "$rounds" \
    --json "$out/train.json" --no-plot --note "benchmarks/gpu.sh"
fi
if [[ $parts == *" merge "* ]]; then
  "$py" -m functorch_optim bench --from-json "$out/steps.json" "$out/train.json" \
    --json "$out/gpu.json" --markdown "$out/gpu.md" --no-plot
fi

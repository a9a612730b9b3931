#!/usr/bin/env bash
# Set up the project virtualenv (.venv) and run the test suite. Idempotent; safe on a fresh clone.
#
#   bash scripts/test.sh                 # set up, then run all tests
#   bash scripts/test.sh -k packaging    # extra arguments go to pytest
#   bash scripts/test.sh --setup-only    # set up only (used by scripts/smoke.sh)
#
# PYTHON selects the interpreter that creates .venv (default: python3; must match requires-python).
# TEST_SEED=N replays a shuffled test order (the seed is printed on every run); TEST_SEED=file keeps the file order.
# TEST_WORKERS=N runs N pytest-xdist workers (default: one per core; 0: none).
# Exits with pytest's status, so "no tests ran" (5) fails too.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# VENV and CONSTRAINTS select another virtualenv and TRL (.ci/run: .venv-trl-newest with constraints-trl-newest.txt).
VENV="${VENV:-.venv}"
CONSTRAINTS="${CONSTRAINTS:-constraints.txt}"
STAMP="$VENV/.papo_nb-installed"

setup() {
    local start=$SECONDS
    if [[ ! -x "$VENV/bin/python" ]]; then
        echo "==> creating $VENV with ${PYTHON:-python3}"
        "${PYTHON:-python3}" -m venv "$VENV"
        "$VENV/bin/python" -m pip install --upgrade pip
    fi
    # Reinstall only when pyproject.toml or the constraints changed since the last successful install.
    local want
    want="$(cat pyproject.toml "$CONSTRAINTS" | sha256sum | cut -d' ' -f1)"
    if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
        echo "==> $VENV is up to date with pyproject.toml"
    else
        echo "==> pip install -e '.[test]' -c $CONSTRAINTS"
        rm -f "$STAMP"
        "$VENV/bin/python" -m pip install -e '.[test]' -c "$CONSTRAINTS"
        echo "$want" >"$STAMP"
    fi
    echo "==> install wall time: $((SECONDS - start)) s"
}

setup
if [[ "${1:-}" == "--setup-only" ]]; then
    exit 0
fi

# Debian's chromium for the browser tests where this machine can install it; otherwise one line says which skip.
bash scripts/chromium.sh

start=$SECONDS
rc=0
# A shuffled order (pytest-randomly), its seed printed so that a failing order can be replayed:
# TEST_SEED=N replays one, TEST_SEED=file keeps the file order.
seed="${TEST_SEED:-$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')}"
if [[ ! "$seed" =~ ^([0-9]+|file)$ ]]; then
    echo "TEST_SEED='$seed' is invalid: a non-negative integer (a shuffled order's seed) or 'file'" >&2
    exit 2
fi
if [[ "$seed" == "file" ]]; then
    echo "==> test order: file order (TEST_SEED=file)"
    order=(-p no:randomly)
else
    echo "==> test order: shuffled, seed $seed (replay: TEST_SEED=$seed bash scripts/test.sh)"
    order=(-p randomly "--randomly-seed=$seed")
fi
# One pytest-xdist worker per core (TEST_WORKERS=N sets the count; 0 runs in this process), each test file whole on
# one worker so its module fixtures are built once. Each worker computes with one thread (unless OMP_NUM_THREADS is
# set): two-thread workers on two cores would oversubscribe them. The seed fixes each file's test order; which worker
# runs which file depends on timing, so TEST_WORKERS=0 with the seed replays one failing order exactly.
workers="${TEST_WORKERS:-auto}"
if [[ ! "$workers" =~ ^([0-9]+|auto)$ ]]; then
    echo "TEST_WORKERS='$workers' is invalid: a non-negative integer (0: no workers) or 'auto' (one per core)" >&2
    exit 2
fi
if [[ "$workers" == "0" ]]; then
    parallel=(-p no:xdist)
else
    parallel=(-n "$workers" --dist loadfile)
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
fi
echo "==> test workers: $workers (TEST_WORKERS), threads per worker: ${OMP_NUM_THREADS:-the torch default}"
"$VENV/bin/python" -m pytest "${order[@]}" "${parallel[@]}" --durations=25 "$@" || rc=$?
echo "==> tests wall time: $((SECONDS - start)) s (pytest exit code $rc, test order seed $seed, workers $workers)"
exit "$rc"

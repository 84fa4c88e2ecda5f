#!/usr/bin/env bash
# The quickstart: `bash run.sh demo` runs the demo, `bash run.sh test` runs the tests.
# Both make ./.venv (Python >= 3.11) and install the project into it on first use.
set -euo pipefail
cd "$(dirname "$0")"

pick_python() {
  for candidate in "${PYTHON:-}" python3.13 python3.12 python3.11 python3; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
      "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
  echo "error: mlx-supervisor needs Python >= 3.11 (set PYTHON=/path/to/python)" >&2
  exit 2
}

ensure_venv() {
  local stamp=.venv/.installed
  if [ ! -x .venv/bin/python ]; then
    "$(pick_python)" -m venv .venv
  fi
  # Reinstall when pyproject.toml changes.
  local want
  want=$(cksum pyproject.toml | cut -d' ' -f1)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[dev]'
    echo "$want" >"$stamp"
  fi
}

command=${1:-demo}
shift || true
case "$command" in
  demo)
    ensure_venv
    exec .venv/bin/mlx-supervisor demo "$@"
    ;;
  test|test-slow|test-all)
    ensure_venv
    # Two workers: most tests wait on child processes, so two run side by side even on
    # two cores. TEST_WORKERS=0 runs them in this process (for pdb, or -x).
    # `test` leaves out the tests marked slow (real-model answers, the short soak and fuzz
    # runs, slow-prefill timing: about a minute and a half more); `test-slow` runs only
    # those (CI runs both); `test-all` runs every test at once.
    case "$command" in
      test) select="not slow" ;;
      test-slow) select="slow" ;;
      *) select="" ;;
    esac
    exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist worksteal \
      -m "$select" "$@"
    ;;
  lint)
    ensure_venv
    .venv/bin/ruff check src tests bench
    exec .venv/bin/mypy
    ;;
  bench)
    # bash run.sh bench [all|daemon|recovery|hardening|memory|engine|http|fronts|prefill|constrained|tool_parsers|kv_quant|distributed|real|disk_cache|disk_integrity|blas|dashboard|vision|embeddings|speculative] [script args...]
    ensure_venv
    which=${1:-all}
    shift || true
    if [ "$which" = all ]; then
      for name in daemon recovery hardening memory engine http real fronts prefill constrained tool_parsers dashboard; do
        echo "== bench/bench_$name.py" >&2
        .venv/bin/python "bench/bench_$name.py" "$@"
      done
      exit 0
    fi
    if [ ! -f "bench/bench_$which.py" ]; then
      echo "usage: bash run.sh bench [all|daemon|recovery|hardening|memory|engine|http|fronts|prefill|constrained|tool_parsers|kv_quant|distributed|real|disk_cache|disk_integrity|blas|dashboard|vision|embeddings|speculative] [args...]" >&2
      exit 2
    fi
    exec .venv/bin/python "bench/bench_$which.py" "$@"
    ;;
  system)
    # What some tests need beyond Python packages; they skip, saying so, without it.
    # Debian/Ubuntu: chromium (the dashboard's browser test, driven by Playwright) and
    # OpenBLAS (runners' cpu_blas = "auto"). A Mac needs no OpenBLAS (Accelerate); for
    # the browser test: `brew install --cask chromium` and
    # MLX_SUPERVISOR_CHROMIUM="/Applications/Chromium.app/Contents/MacOS/Chromium".
    packages="chromium libopenblas0-pthread"
    if [ "$(uname -s)" = Darwin ]; then
      echo "run.sh system: on a Mac, for the browser test: brew install --cask chromium, then" >&2
      echo "  export MLX_SUPERVISOR_CHROMIUM=/Applications/Chromium.app/Contents/MacOS/Chromium" >&2
      exit 0
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
      echo "run.sh system: no apt-get here; install by hand: $packages" >&2
      exit 0
    fi
    missing=$(for p in $packages; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
    [ -n "$missing" ] || exit 0
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo -n"
    # shellcheck disable=SC2086
    if ! { $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing ||
      { $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends $missing; }; } >&2; then
      echo "run.sh system: could not install $missing; the tests needing them skip" >&2
    fi
    ;;
  soak)
    ensure_venv
    duration=${1:-600}
    shift || true
    mkdir -p bench/results
    exec .venv/bin/python tests/soak/soak_run.py --duration "$duration" \
      --out bench/results/soak.json "$@"
    ;;
  fuzz)
    ensure_venv
    cases=${1:-10000}
    shift || true
    mkdir -p bench/results
    exec .venv/bin/python tests/fuzz/fuzz_run.py --cases "$cases" \
      --out bench/results/fuzz.json "$@"
    ;;
  *)
    echo "usage: bash run.sh demo|test|test-slow|test-all|lint|system|bench|soak|fuzz [args...]" >&2
    exit 2
    ;;
esac

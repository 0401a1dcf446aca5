#!/usr/bin/env bash
# Issue 8's start-up figure for --enable-torch-compile: `fw serve` from process start to ready, cold
# (an empty FW_CACHE_DIR) and after `fw warm-cache` with the same flags (in a second empty FW_CACHE_DIR).
# Each server is stopped once it logs `startup: ready`. Usage: scripts/measure_compile_start.sh [engine flags]
# (run inside fw's venv; prints every start-up phase of each run). Logs go to $OUT (default a temp dir).
set -u
OUT=${OUT:-$(mktemp -d)}
PORT=${PORT:-8199}
serve_until_ready() {  # $1 = label; the rest of the arguments are passed on
  local label=$1; shift
  local log=$OUT/$label.log
  fw serve --enable-torch-compile --port "$PORT" "$@" >"$log" 2>&1 &
  local pid=$!
  until grep -q "startup: ready" "$log"; do
    kill -0 "$pid" 2>/dev/null || { echo "$label: fw serve exited before ready (see $log)"; return 1; }
    sleep 1
  done
  echo "== $label"; grep "startup:" "$log"
  kill -INT "$pid"; wait "$pid"
}
export FW_CACHE_DIR=$(mktemp -d)
serve_until_ready cold "$@"
export FW_CACHE_DIR=$(mktemp -d)
echo "== fw warm-cache"
start=$(date +%s)
fw warm-cache --enable-torch-compile "$@" >"$OUT/warm-cache.log" 2>&1
echo "took $(( $(date +%s) - start )) s; $(tail -1 "$OUT/warm-cache.log")"
echo "== fw warm-cache --check"; fw warm-cache --enable-torch-compile --check "$@" 2>&1 | tail -1
serve_until_ready warm "$@"

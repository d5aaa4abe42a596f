#!/usr/bin/env bash
# Scenario: a nightly cron job is installed on three machines and must run on one only.
#
#   examples/cron/run-once.sh zk://127.0.0.1:2181        # or etcd://, redis://, redlock://
#
# The three "machines" are three `dlock exec` processes started at the same moment, as
# three crontabs would fire. Checks (exit 1 if any is broken):
#   - the job ran exactly once, and every machine exited 0;
#   - the exit-code contract scripts rely on: 75 when the lock is busy past --timeout,
#     the command's own code otherwise, 64 for a bad lock name, 69 for an unreachable
#     backend.
# Needs the dlock CLI: $DLOCK_BIN, or `dlock` on PATH (cargo build -p dlock-cli --bin dlock).
set -uo pipefail

url="${1:-${DLOCK_URL:-}}"
if [ -z "$url" ]; then
    echo "usage: $0 URL   (or set DLOCK_URL)" >&2
    exit 64
fi
dlock="${DLOCK_BIN:-dlock}"
if ! command -v "$dlock" >/dev/null 2>&1; then
    echo "run-once: no dlock CLI at '$dlock': build it with cargo build -p dlock-cli --bin dlock and set DLOCK_BIN" >&2
    exit 69
fi
here="$(cd "$(dirname "$0")" && pwd)"
state="$(mktemp -d "${TMPDIR:-/tmp}/dlock-cron-example.XXXXXX")"
trap 'rm -rf "$state"' EXIT
lock="examples/$$-$RANDOM/cron/nightly-report"
broken=0
check() { # check CONDITION-RESULT DESCRIPTION
    if [ "$1" = 0 ]; then echo "  ok: $2"; else echo "  BROKEN: $2"; broken=1; fi
}

echo "cron run-once on $url"

# 1. Three machines fire at once.
pids=()
for m in machine-1 machine-2 machine-3; do
    REPORT_STATE_DIR="$state" REPORT_PERIOD=2026-01-01 REPORT_MACHINE="$m" \
        "$dlock" --url "$url" exec --timeout 60s "$lock" -- "$here/nightly-report.sh" \
        > "$state/$m.out" 2>&1 &
    pids+=("$!")
done
codes=()
for p in "${pids[@]}"; do
    wait "$p"
    codes+=("$?")
done
sed 's/^/    /' "$state"/machine-*.out
runs=$(wc -l < "$state/runs.log" 2>/dev/null || echo 0)
[ "$runs" -eq 1 ]; check $? "the job ran exactly once (runs: $runs)"
[ "${codes[*]}" = "0 0 0" ]; check $? "every machine exited 0 (exit codes: ${codes[*]})"

# 2. Exit codes. A machine holds the lock for a while...
"$dlock" --url "$url" exec "$lock" -- sleep 5 > /dev/null 2>&1 &
holder=$!
held=1
for _ in $(seq 1 100); do
    if "$dlock" --url "$url" status --json "$lock" 2>/dev/null | grep -q '"state":"holder"'; then
        held=0
        break
    fi
    sleep 0.1
done
check $held "dlock status shows the holder"
# ...so a second one gives up after its timeout with 75 (EX_TEMPFAIL): skip this run.
"$dlock" --url "$url" exec --timeout 500ms "$lock" -- true > /dev/null 2>&1
code=$?
[ "$code" -eq 75 ]; check $? "busy lock past --timeout exits 75 (got $code)"
wait "$holder"
# The command's own exit code comes back once the lock is free.
"$dlock" --url "$url" exec --timeout 30s "$lock" -- sh -c 'exit 3' > /dev/null 2>&1
code=$?
[ "$code" -eq 3 ]; check $? "the command's own exit code is passed through (got $code)"
"$dlock" --url "$url" exec "bad//name" -- true > /dev/null 2>&1
code=$?
[ "$code" -eq 64 ]; check $? "a bad lock name exits 64 (got $code)"
scheme="${url%%://*}"
case "$scheme" in
    redlock) nowhere="redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3" ;;
    *) nowhere="$scheme://127.0.0.1:1" ;;
esac
"$dlock" --url "$nowhere" --connect-timeout 1s exec "$lock" -- true > /dev/null 2>&1
code=$?
[ "$code" -eq 69 ]; check $? "an unreachable backend exits 69 (got $code)"

if [ "$broken" = 0 ]; then echo "cron run-once: PASS"; exit 0; fi
echo "cron run-once: FAIL"
exit 1

#!/bin/sh
# The job itself: what every machine's crontab runs, through `dlock exec`, e.g.
#
#   0 2 * * *  dlock --url zk://zk1:2181,zk2:2181,zk3:2181 exec --timeout 10m \
#                  cron/nightly-report -- /opt/report/nightly-report.sh
#
# `dlock exec` runs it only while this machine holds the lock `cron/nightly-report`, with
# DLOCK_TOKEN (the fencing token) and DLOCK_NAME set. The lock makes runs one-at-a-time;
# the period marker below makes the job run once per period: the machines whose cron
# fired at the same moment get the lock after the first one and find the period done.
# Keep the marker in storage every machine sees (a database row, an object store); the
# examples use a shared directory, REPORT_STATE_DIR.
set -eu

: "${REPORT_STATE_DIR:?set REPORT_STATE_DIR to the shared state directory}"
: "${DLOCK_TOKEN:?run me through dlock exec}"
period="${REPORT_PERIOD:-$(date +%F)}"
me="${REPORT_MACHINE:-$(hostname)}"

if [ "$(cat "$REPORT_STATE_DIR/last-period" 2>/dev/null || true)" = "$period" ]; then
    echo "$me: report for $period already made; nothing to do"
    exit 0
fi

echo "$me: making the report for $period (fencing token $DLOCK_TOKEN)"
sleep 1    # the work
echo "$period $me token=$DLOCK_TOKEN" >> "$REPORT_STATE_DIR/runs.log"
echo "$period" > "$REPORT_STATE_DIR/last-period"

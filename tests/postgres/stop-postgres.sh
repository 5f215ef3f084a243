#!/usr/bin/env bash
# Stop the server that start-postgres.sh started in $PG_DIR and remove its cluster.
set -u
PG_DIR=${PG_DIR:?PG_DIR must name the cluster directory}
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
as() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
[ -n "$bin" ] && [ -d "$PG_DIR/data" ] && as "$bin/pg_ctl" -D "$PG_DIR/data" -m immediate -w stop >/dev/null 2>&1
rm -rf "$PG_DIR"

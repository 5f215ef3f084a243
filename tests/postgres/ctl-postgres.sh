#!/usr/bin/env bash
# Stop, start or restart the server that start-postgres.sh made in $PG_DIR,
# on the port and with the options it started with (a fast stop: every
# client's connection is dropped). Usage: PG_DIR=DIR ctl-postgres.sh stop|start|restart
set -euo pipefail
PG_DIR=${PG_DIR:?PG_DIR must name the cluster directory}
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
as() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
case "${1:?usage: ctl-postgres.sh stop|start|restart}" in
  stop) as "$bin/pg_ctl" -D "$PG_DIR/data" -m fast -w -t 60 stop >/dev/null ;;
  start|restart) as "$bin/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w -t 60 "$1" >/dev/null ;;
  *) echo "ctl-postgres: stop, start or restart" >&2; exit 2 ;;
esac

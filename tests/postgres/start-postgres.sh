#!/usr/bin/env bash
# Start a throwaway PostgreSQL server for the tests: the operating system's
# postgresql package, a fresh cluster in $PG_DIR, listening on 127.0.0.1:PORT
# and on a Unix socket in $PG_DIR. Runs as root or not: as root the cluster
# belongs to the 'postgres' user (PostgreSQL refuses to run as root).
# synchronous_commit stays on (the default): a durable length recorded there
# is acknowledged to an agent.
# Prints one line: the connection URL (postgresql://gcwrap@127.0.0.1:PORT/gcwrap).
# Usage: PG_DIR=DIR start-postgres.sh PORT; stop with PG_DIR=DIR stop-postgres.sh
set -euo pipefail
PORT=${1:?usage: start-postgres.sh PORT}
PG_DIR=${PG_DIR:?PG_DIR must name the cluster directory}
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$bin" ] || [ ! -x "$bin/initdb" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >/dev/null
    bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
  else
    echo "start-postgres: PostgreSQL is not installed (apt-get install postgresql)" >&2; exit 1
  fi
fi
as() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
rm -rf "$PG_DIR"; mkdir -p "$PG_DIR"
[ "$(id -u)" = 0 ] && chown postgres: "$PG_DIR"
as "$bin/initdb" -D "$PG_DIR/data" -U gcwrap --auth=trust -E UTF8 >"$PG_DIR/initdb.log" 2>&1
# In its configuration, not on pg_ctl's command line: ctl-postgres.sh starts it again as it was.
cat >>"$PG_DIR/data/postgresql.conf" <<CONF
port = $PORT
unix_socket_directories = '$PG_DIR'
listen_addresses = '127.0.0.1'
fsync = on
max_connections = 200
CONF
if ! as "$bin/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w -t 60 start >/dev/null; then
  tail -5 "$PG_DIR/server.log" >&2 || true
  exit 1
fi
as "$bin/createdb" -h 127.0.0.1 -p "$PORT" -U gcwrap gcwrap
echo "postgresql://gcwrap@127.0.0.1:$PORT/gcwrap"

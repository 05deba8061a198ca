#!/bin/sh
# The PostgreSQL image's start: initdb on first start (superuser `memfilter`, trusted from any
# address of the container's network), then the server in the foreground.
set -eu
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
if [ ! -f /data/pgdata/PG_VERSION ]; then
  "$bin/initdb" -D /data/pgdata -U memfilter --auth=trust -E UTF8 --no-instructions > /dev/null
  echo "host all all all trust" >> /data/pgdata/pg_hba.conf
fi
exec "$bin/postgres" -D /data/pgdata -c listen_addresses='*' -c unix_socket_directories=/tmp

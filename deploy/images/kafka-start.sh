#!/bin/sh
# Writes server.properties from the KAFKA_* variables (KAFKA_LOG_RETENTION_MS=-1 is
# log.retention.ms=-1), formats the storage on first start, and runs the broker.
set -eu
home=/var/lib/kafka
props="$home/server.properties"
env | grep '^KAFKA_' | while IFS='=' read -r name value; do
  echo "$(echo "${name#KAFKA_}" | tr 'A-Z_' 'a-z.')=$value"
done > "$props"
grep -q '^log.dirs=' "$props" || echo "log.dirs=$home/data" >> "$props"
data=$(sed -n 's/^log.dirs=//p' "$props" | cut -d, -f1)
classpath='/opt/kafka/libs/*'
if [ ! -f "$data/meta.properties" ]; then
  java -cp "$classpath" kafka.tools.StorageTool format -t "${CLUSTER_ID:-$(java -cp "$classpath" kafka.tools.StorageTool random-uuid)}" -c "$props" > /dev/null
fi
exec java -Xms256m -Xmx1g -Dorg.slf4j.simpleLogger.defaultLogLevel=warn -cp "$classpath" kafka.Kafka "$props"

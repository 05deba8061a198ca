# Kafka (KRaft) from the Maven Central jars `memfilter stack up` uses, on Debian's JRE
# (deploy/images.sh builds it with the jars as its context). Configured as apache/kafka's image
# is: each KAFKA_* variable is a server property (KAFKA_NODE_ID=1 is node.id=1), CLUSTER_ID
# names the cluster; /opt/kafka/bin/kafka-topics.sh is there for health checks and topics.
ARG BASE=debian:bookworm-slim
FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/* && useradd --system --home-dir /var/lib/kafka --create-home kafka
COPY libs/ /opt/kafka/libs/
COPY kafka-start.sh /opt/kafka/bin/
RUN printf '#!/bin/sh\nexec java -Dorg.slf4j.simpleLogger.defaultLogLevel=warn -cp "/opt/kafka/libs/*" org.apache.kafka.tools.TopicCommand "$@"\n' > /opt/kafka/bin/kafka-topics.sh \
    && chmod +x /opt/kafka/bin/*.sh
USER kafka
EXPOSE 9092
CMD ["/opt/kafka/bin/kafka-start.sh"]

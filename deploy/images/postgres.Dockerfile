# PostgreSQL from Debian's postgresql (deploy/images.sh): the history's PostgreSQL tier
# (docs/postgres.md). Data in /data; listens on 5432 on every interface of its container, the
# superuser `memfilter` trusted: the network it is put on decides who reaches it (Compose's has
# no route out and publishes on loopback only).
ARG BASE=debian:bookworm-slim
FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends postgresql \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown postgres:postgres /data
COPY postgres-start.sh /usr/local/bin/postgres-start.sh
USER postgres
WORKDIR /data
EXPOSE 5432
CMD ["/usr/local/bin/postgres-start.sh"]

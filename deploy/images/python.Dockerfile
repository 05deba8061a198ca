# Python 3.11 on Debian bookworm: this machine's stand-in for python:3.11-slim (deploy/images.sh).
ARG BASE=debian:bookworm-slim
FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

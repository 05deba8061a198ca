# The worker image used by docker-compose.yml and deploy/k8s: `memfilter` on Python 3.11.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY streams ./streams
RUN pip install --no-cache-dir .
USER nobody
# Settings come from the environment (README: settings); the web server serves
# /metrics, /healthz and /readyz on MEMFILTER_WEB_PORT.
ENV MEMFILTER_WEB_BIND=0.0.0.0 MEMFILTER_WEB_PORT=6066 MEMFILTER_DATA_DIR=/tmp/memfilter
EXPOSE 6066
CMD ["memfilter", "worker", "--loglevel", "info"]

# The worker image used by docker-compose.yml and deploy/k8s: `memfilter` on Python 3.11
# (`memfilter worker` by default; `memfilter agent` runs the reference agent runner).
# PYTHON is the base: the official python:3.11-slim where a registry is reachable, the image
# deploy/images.sh makes from Debian's packages where none is (MEMFILTER_IMAGE_PYTHON).
ARG PYTHON=python:3.11-slim
FROM ${PYTHON}
WORKDIR /app
# The dependencies first, from pyproject.toml alone, so a change to the code rebuilds only the last step.
COPY pyproject.toml README.md ./
RUN mkdir schemas streams && touch schemas/__init__.py streams/__init__.py && python3 -m venv /opt/memfilter \
    && /opt/memfilter/bin/pip install --no-cache-dir --disable-pip-version-check -q . && rm -r schemas streams
COPY schemas ./schemas
COPY streams ./streams
RUN /opt/memfilter/bin/pip install --no-cache-dir --disable-pip-version-check -q --no-deps --force-reinstall .
ENV PATH=/opt/memfilter/bin:$PATH
USER nobody
# Settings come from the environment (README: settings); the web server serves
# /metrics, /healthz and /readyz on MEMFILTER_WEB_PORT.
ENV MEMFILTER_WEB_BIND=0.0.0.0 MEMFILTER_WEB_PORT=6066 MEMFILTER_DATA_DIR=/tmp/memfilter
EXPOSE 6066
CMD ["memfilter", "worker", "--loglevel", "info"]

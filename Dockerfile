# The product's image, used by docker-compose.yml and deploy/k8s: `memfilter` on Python 3.11 with
# every extra (worker, agent, gateway, tokens), so each part runs from it: `memfilter worker` by
# default; `memfilter sink`, `memfilter agent`, `memfilter gateway` and the admin commands
# (history, forget, replay) as the container's command.
# PYTHON is the base: the official python:3.11-slim where a registry is reachable, the image
# deploy/images.sh makes from Debian's packages where none is (MEMFILTER_IMAGE_PYTHON).
ARG PYTHON=python:3.11-slim
FROM ${PYTHON}
WORKDIR /app
# The dependencies first, from pyproject.toml and the constraints alone, so a change to the code
# rebuilds only the last step.
COPY pyproject.toml deploy/constraints.txt ./
RUN python3 -m venv /opt/memfilter && python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
    wanted = p['dependencies'] + [d for extra in ('worker', 'agent', 'gateway', 'tokens') for d in p['optional-dependencies'][extra]]; \
    print('\\n'.join(d for d in wanted if not d.startswith('memfilter')))" > requirements.txt \
    && /opt/memfilter/bin/pip install --no-cache-dir --disable-pip-version-check -q -c constraints.txt -r requirements.txt
COPY README.md setup.py ./
COPY schemas ./schemas
COPY streams ./streams
# Built as a wheel, as a user installs it (not editable), then the build's leftovers removed.
RUN /opt/memfilter/bin/pip install --no-cache-dir --disable-pip-version-check -q --no-deps . && rm -rf /app/build
ENV PATH=/opt/memfilter/bin:$PATH
USER nobody
# Settings come from the environment (docs/settings.md); the web servers serve /metrics,
# /healthz and /readyz: the worker's on MEMFILTER_WEB_PORT, the agent runner's on
# MEMFILTER_AGENT_WEB_PORT, the sink's on MEMFILTER_SINK_WEB_PORT, the gateway's (and its chat
# page) on MEMFILTER_GATEWAY_PORT.
ENV MEMFILTER_WEB_BIND=0.0.0.0 MEMFILTER_GATEWAY_BIND=0.0.0.0 MEMFILTER_WEB_PORT=6066 MEMFILTER_DATA_DIR=/tmp/memfilter
EXPOSE 6066 6067 6068 6069 6070
CMD ["memfilter", "worker", "--loglevel", "info"]

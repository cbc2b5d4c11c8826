# The scheduler image (`sparkwire scheduler ...`): a CUDA base, with a C compiler and the Python
# headers because Triton compiles its kernels' launchers when they first run; torch on its own layer.
# CPU profile (compose.yaml `scheduler-cpu`): BASE_IMAGE=debian:bookworm-slim and the CPU wheel index.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
# pyproject.toml extras installed beside `scheduler`: flash4 (FlashAttention-4 for long prefills) on
# the CUDA image; the CPU profile sets none
ARG SCHEDULER_EXTRAS="flash4"

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPARKWIRE_LOG_FORMAT=json \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install "torch==${TORCH_VERSION}"; \
    fi

WORKDIR /app
# The other dependencies (the project's and those of the scheduler extra and SCHEDULER_EXTRAS), from pyproject.toml alone:
# rebuilt only when they change, not on every source edit. An extra's `sparkwire[...]` (itself) is left out: the
# project is installed from the source below, and its name is not on PyPI.
COPY pyproject.toml ./
RUN python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = ['scheduler', *os.environ.get('SCHEDULER_EXTRAS', '').split()]; \
own = [d for e in extras for d in p['optional-dependencies'][e] if not d.startswith('sparkwire[')]; \
print('\n'.join(p['dependencies'] + own))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

COPY README.md LICENSE ./
COPY contracts ./contracts
COPY services ./services
COPY ops ./ops
RUN pip install --no-deps . && rm -rf /app/build

RUN useradd --create-home --uid 10001 sparkwire
USER sparkwire
EXPOSE 9090
CMD ["sparkwire", "scheduler", "--help"]

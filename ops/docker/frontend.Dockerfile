# The tokenizer and detokenizer image: slim and torch-free (`sparkwire tokenizer|detokenizer ...`).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPARKWIRE_LOG_FORMAT=json

WORKDIR /app
# Dependencies first, read from pyproject.toml alone: this layer is rebuilt only when they change,
# not on every source edit.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

COPY README.md LICENSE ./
COPY contracts ./contracts
COPY services ./services
COPY ops ./ops
RUN pip install --no-deps . && rm -rf /app/build

RUN useradd --create-home --uid 10001 sparkwire
# Where compose mounts the tokenizers' shared metrics volume: a new volume takes this directory's
# owner, so the tokenizers (not root) can write their counts there.
RUN mkdir -p /var/lib/sparkwire/metrics && chown sparkwire:sparkwire /var/lib/sparkwire/metrics
USER sparkwire
EXPOSE 8000 9090
CMD ["sparkwire", "--help"]

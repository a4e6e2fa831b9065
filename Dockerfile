# The replicadp image: a replica (`celery -A replicadp_tasks worker`), and the `replicadp` commands (flower,
# metrics, health). CUDA PyTorch base; any tag with Python >= 3.11 and torch >= 2.4 works:
#   docker build --build-arg BASE=pytorch/pytorch:<tag> .
ARG BASE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/cache/huggingface \
    REPLICADP_MODEL_CACHE=/cache/replicadp \
    OUTPUT_DIR=/outputs

WORKDIR /opt/replicadp
COPY pyproject.toml README.md celeryconfig.py ./
COPY replicadp_tasks replicadp_tasks
COPY client client
# The base image's torch satisfies `torch>=2.4`, so pip keeps that CUDA build instead of fetching another.
RUN pip install . \
 && useradd --create-home --uid 1000 replicadp \
 && mkdir -p /cache /outputs \
 && chown replicadp /cache /outputs

# Not root: a replica runs prompts and images from the network. Docker seeds an empty named volume with the
# mount point's owner, so the model cache and the outputs are writable by this user.
USER replicadp
WORKDIR /home/replicadp
VOLUME ["/cache", "/outputs"]
CMD ["celery", "-A", "replicadp_tasks", "worker", "-n", "replica0@%h"]

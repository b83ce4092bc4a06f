# mme-gpu: a SageMaker multi-model endpoint image serving PyTorch models on GPU with MMS 1.1.11.
#
#   docker build -t mme-gpu .                      # CUDA 13.0 base, torch's CUDA 13.0 build from PyPI
#   docker run --gpus all -p 8080:8080 mme-gpu     # as SageMaker does: `docker run IMAGE serve`
#
# scripts/test-image builds it and checks PING, LOAD, INVOKE, UNLOAD and a clean SIGTERM stop; it also runs
# where there is no Docker engine (podman, on a local Debian base): see tests/container/README.md.
# MMS, sagemaker-inference and the other Python dependencies are pinned once, in requirements.txt, which
# `make install` reads too; only torch is chosen here, because the image and a laptop want different builds.

# Versions are top-level ARGs so CI can bump them without editing the file; pin the base by digest in CI.
# CUDA 13.0 matches the CUDA that torch 2.13.0's PyPI wheels are built for (cu130), so the base's forward-
# compatibility libraries (/usr/local/cuda/compat) fit the torch build. The build also works on a plain
# Debian 12 or Ubuntu 24.04 base (scripts/test-image uses a local debian:bookworm).
ARG BASE_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
ARG JAVA_VERSION=17
# The venv's pip is the distribution's (23.0 on Debian 12, 24.0 on Ubuntu 24.04); one pinned pip behaves the
# same on both and builds sdists (sagemaker-inference has no wheel) the PEP 517 way, like `make install`.
ARG PIP_VERSION=26.3
# On Linux x86_64, `torch==2.13.0` from the default index is the CUDA 13.0 build; it pulls the CUDA runtime,
# cuBLAS and cuDNN as pip packages (several GB). Other builds: TORCH_SPEC=torch==2.13.0+cpu with
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu, or PIP_INDEX_URL=https://download.pytorch.org/whl/cu126.
ARG TORCH_SPEC=torch==2.13.0

FROM ${BASE_IMAGE}

# An ARG declared before FROM is visible only to FROM; declaring it again (without a value) brings the default
# or the --build-arg value into this stage. Each is declared just before the first layer that uses it, since
# every RUN after the declaration is rebuilt when the value changes.
ARG JAVA_VERSION

LABEL com.amazonaws.sagemaker.capabilities.multi-models=true \
      com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true

# PYTORCH_NVML_BASED_CUDA_CHECK makes torch.cuda.is_available() ask NVML instead of initialising CUDA, so user
# code may call it in the preload server before the fork (see DESIGN.md, "GPU-safe preload").
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LANG=C.UTF-8 \
    PYTORCH_NVML_BASED_CUDA_CHECK=1 \
    PATH=/opt/venv/bin:${PATH}

# OS packages: Java for the MMS frontend, Python with venv for everything else. The same names exist on
# Ubuntu 24.04 (Python 3.12) and Debian 12 (Python 3.11); versions come from the pinned base image, hence no
# apt pins. No compilers: every Python dependency installs from a wheel or a pure-Python sdist.
# The man1 directory: the JRE's postinst adds man-page alternatives, which fail on images that exclude
# /usr/share/man (debuerreotype/debuerreotype#10, the Ubuntu images do). Every java run (the JRE's own
# postinst, our check) leaves /tmp/hsperfdata_root behind.
# hadolint ignore=DL3008
RUN set -eux; \
    mkdir -p /usr/share/man/man1; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        ca-certificates \
        "openjdk-${JAVA_VERSION}-jre-headless" \
        python3 \
        python3-venv \
    ; \
    python3 -m venv /opt/venv; \
    java -version; \
    python --version; \
    rm -rf /var/lib/apt/lists/* /tmp/hsperfdata_root

# pip settings for the build only (a mirror, a local wheel directory, a private CA). ARGs reach RUN as
# environment variables and are not kept in the image's ENV; they do show in `docker history`, so pass an
# index that needs credentials as a build secret, not here.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CERT
ARG PIP_FIND_LINKS
ARG PIP_VERSION
ARG TORCH_SPEC

# torch in a layer of its own: by far the largest (GBs with CUDA), and it changes only with TORCH_SPEC.
# TORCH_SPEC is pinned (==) but hadolint cannot see through the variable.
# hadolint ignore=DL3013
RUN set -eux; \
    python -m pip install --no-cache-dir "pip==${PIP_VERSION}"; \
    python -m pip install --no-cache-dir "${TORCH_SPEC}"

# requirements.txt may move torch's own dependencies (it keeps setuptools<81); pip check proves the result
# consistent, and the imports prove torch, MMS and the toolkit load together.
COPY requirements.txt /tmp/mme-src/requirements.txt
RUN set -eux; \
    python -m pip install --no-cache-dir -r /tmp/mme-src/requirements.txt; \
    python -m pip check; \
    python -c 'import mms, sagemaker_inference, torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

# Our code last: it changes most often. .dockerignore lets in only what the package and the entrypoint need.
# --no-build-isolation builds with the setuptools that requirements.txt installed instead of fetching another.
COPY . /tmp/mme-src/
RUN set -eux; \
    python -m pip install --no-cache-dir --no-deps --no-build-isolation /tmp/mme-src; \
    mkdir -p /opt/mme; \
    install -m 0755 /tmp/mme-src/dockerd-entrypoint.py /opt/mme/dockerd-entrypoint.py; \
    install -m 0644 /tmp/mme-src/mme-mms.properties /opt/mme/mme-mms.properties; \
    rm -rf /tmp/mme-src; \
    python -c 'import handler_service, inference_handler, mme_runtime.processes.supervisor'

# SageMaker sends requests to 8080 unless it passes SAGEMAKER_BIND_TO_PORT (the label above allows that);
# 9090 serves Prometheus metrics (MME_METRICS_PORT).
EXPOSE 8080 9090

# The entrypoint is PID 1: it forwards SIGTERM to MMS and its workers, reaps orphans and exits with MMS's
# status, so no init (tini) is wanted; SageMaker also requires an exec-form ENTRYPOINT and runs `IMAGE serve`.
# `python` is the venv's (PATH above). There is no HEALTHCHECK: SageMaker polls GET /ping itself.
ENTRYPOINT ["python", "/opt/mme/dockerd-entrypoint.py"]
CMD ["serve"]

# Provenance last, so that a new commit does not invalidate the layers above.
ARG IMAGE_SOURCE=""
ARG IMAGE_VERSION=""
ARG IMAGE_REVISION=""
LABEL org.opencontainers.image.source="${IMAGE_SOURCE}" \
      org.opencontainers.image.version="${IMAGE_VERSION}" \
      org.opencontainers.image.revision="${IMAGE_REVISION}"

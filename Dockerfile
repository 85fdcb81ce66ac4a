# CPU image of the server. Models are fetched on first start into /models (a volume), the
# corpus into /data. Build: docker build -t ragscope .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --bin ragscope && strip target/release/ragscope

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-pip ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 ragscope \
 && mkdir -p /data /models && chown ragscope /data /models
COPY --from=build /src/target/release/ragscope /usr/local/bin/ragscope
COPY eval /app/eval
WORKDIR /app
ENV RAGSCOPE_DATA_DIR=/data RAGSCOPE_MODELS_DIR=/models PIP_BREAK_SYSTEM_PACKAGES=1
# The corpus comes from apt: refresh the package lists at start, as the unprivileged user can't.
USER root
RUN apt-get update
USER ragscope
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s CMD curl -fsS http://127.0.0.1:8080/ready || exit 1
ENTRYPOINT ["ragscope"]
CMD ["serve", "--listen", "0.0.0.0:8080"]

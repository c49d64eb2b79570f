# syntax=docker/dockerfile:1.7
#
# The nm-gateway image: the one binary, whole-program optimised (Cargo profile `dist`), on a
# distroless base (glibc, libgcc, CA certificates, no shell, no package manager), run as the
# non-root user 65532:65532 that the Helm chart (helm/nm-gateway) also sets. The entrypoint is
# the binary: `docker run IMAGE serve`, `... dataplane`, `... controlplane`, `... keys list`.
#
#   docker build -t nm-gateway:0.1.0 .
#   docker build --build-arg PROFILE=release -t nm-gateway:dev .   # a faster build, ~10% more CPU
#
# The Rust and Debian versions of the two stages must match (the binary links the build stage's
# glibc); override both together with RUST_IMAGE and RUNTIME_IMAGE.

ARG RUST_IMAGE=rust:1.95-slim-trixie
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian13:nonroot

FROM ${RUST_IMAGE} AS build
# The Cargo profile; its output directory is target/<profile> (target/debug for `dev`).
ARG PROFILE=dist
WORKDIR /src
COPY . .
# Cache mounts keep the registry and target/ between builds; the binary is copied out of the
# cache in the same step. --locked: exactly Cargo.lock's versions.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --locked --profile "${PROFILE}" --bin nm-gateway \
 && out="target/${PROFILE}" && if [ "${PROFILE}" = dev ]; then out=target/debug; fi \
 && install -D -m 0755 "${out}/nm-gateway" /out/usr/local/bin/nm-gateway \
 && install -d -m 0750 /out/var/lib/nm-gateway

FROM ${RUNTIME_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="nm-gateway" \
      org.opencontainers.image.description="LLM gateway: provider-native proxy (dataplane) and key/usage/signal store (controlplane)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/usr/local/bin/nm-gateway /usr/local/bin/nm-gateway
# The working directory is writable by the user, so `docker run IMAGE serve` can create its
# default ./nm-data; in Kubernetes the root filesystem is read-only and the chart mounts volumes.
COPY --from=build --chown=65532:65532 /out/var/lib/nm-gateway /var/lib/nm-gateway
WORKDIR /var/lib/nm-gateway
USER 65532:65532
# 8080: dataplane HTTP; 50051: controlplane gRPC.
EXPOSE 8080 50051
ENTRYPOINT ["nm-gateway"]
CMD ["serve"]

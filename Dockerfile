# cozy-proxy image: the binary (eBPF object embedded) and exactly the shared
# libraries it loads, on an empty base -- the same image `cargo xtask image`
# builds with buildah where no container engine runs.
# Build: cargo xtask image [TAG]   (or: docker build -t cozy-proxy .)
#
# Stage 1 builds with the same toolchain the project uses everywhere: rustup's
# stable for userspace (the host's glibc target) and Debian's rustc with its
# std source for the eBPF crate, linked by bpf-linker against LLVM 22.
FROM debian:bookworm AS build
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends \
      ca-certificates curl build-essential pkg-config \
      rustc-web rust-web-src cargo-web llvm-22-dev libzstd-dev zlib1g-dev \
 && rm -rf /var/lib/apt/lists/*
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
ENV PATH=/root/.cargo/bin:$PATH
RUN LLVM_PREFIX=/usr/lib/llvm-22 PATH=/usr/lib/llvm-22/bin:$PATH \
    cargo install bpf-linker --locked --no-default-features --features llvm-22
WORKDIR /src
COPY . .
RUN cargo build --release -p cozy-proxy \
 && install -D target/release/cozy-proxy /out/cozy-proxy \
 && ldd target/release/cozy-proxy | grep -o '/[^ ]*' \
    | xargs -I{} sh -c 'mkdir -p /out$(dirname {}) && cp -L {} /out{}' \
 && mkdir -p /out/proc /out/sys/fs/bpf /out/dev /out/tmp

# Stage 2: nothing but the binary and its libraries. It talks netlink and
# bpf(2) itself (no nft or iproute2 needed) and reaches the API server with
# its own TLS.
FROM scratch
COPY --from=build /out/ /
ENTRYPOINT ["/cozy-proxy"]
CMD ["run"]

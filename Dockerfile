# cozy-proxy image: a static binary (eBPF object embedded) on an empty base.
# Build: cargo xtask image   (or: docker build -t cozy-proxy .)
#
# Stage 1 builds with the same toolchain the project uses everywhere: rustup's
# stable for userspace (musl target, static) and Debian's rustc with its std
# source for the eBPF crate, linked by bpf-linker against LLVM 22.
FROM debian:bookworm AS build
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends \
      ca-certificates curl build-essential musl-tools pkg-config \
      rustc-web rust-web-src cargo-web llvm-22-dev libzstd-dev zlib1g-dev \
 && rm -rf /var/lib/apt/lists/*
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --target x86_64-unknown-linux-musl
ENV PATH=/root/.cargo/bin:$PATH
RUN LLVM_PREFIX=/usr/lib/llvm-22 PATH=/usr/lib/llvm-22/bin:$PATH \
    cargo install bpf-linker --locked --no-default-features --features llvm-22
WORKDIR /src
COPY . .
RUN cargo build --release -p cozy-proxy --target x86_64-unknown-linux-musl \
 && install -D target/x86_64-unknown-linux-musl/release/cozy-proxy /out/cozy-proxy

# Stage 2: nothing but the binary. It talks netlink and bpf(2) itself (no nft
# or iproute2 needed) and reaches the API server with its own TLS.
FROM scratch
COPY --from=build /out/cozy-proxy /cozy-proxy
ENTRYPOINT ["/cozy-proxy"]
CMD ["run"]

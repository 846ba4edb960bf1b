//! The benchmarks of cozy-proxy are this crate's binaries, run by `cargo
//! xtask bench control-plane|datapath|per-packet` (release build, into
//! target/bench, rendered into BENCHMARKS.md): `bench-control-plane` (the
//! controller's time and memory against the API stand-in),
//! `bench-datapath` (packet and connection rates through each datapath,
//! with the no-NAT baseline and the conntrack peer), `bench-per-packet`
//! (each program's time per run under `BPF_PROG_TEST_RUN`). Each measures
//! ratios in one run against a baseline, with an A/A control.

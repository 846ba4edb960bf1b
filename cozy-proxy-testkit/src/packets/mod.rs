//! Crafted frames: built with correct checksums and checked by an
//! independent checksum (`frames`), random and mutated ones for fuzzing
//! (`fuzz`), and our TC programs loaded for `BPF_PROG_TEST_RUN` on maps
//! the production code fills (`bpf`).
//!
//! What they do not model: the path of a frame through the stack (the
//! scenarios send real traffic for that); a test run sees one program's
//! verdict and output on one frame.
pub mod bpf;
pub mod frames;
pub mod fuzz;

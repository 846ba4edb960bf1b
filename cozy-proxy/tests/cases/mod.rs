//! The scenarios listed in README.md here, written once for every backend
//! and family. Each takes a fresh [`cozy_proxy_testkit::Env`].
pub mod bad_input;
pub mod changes;
pub mod filter;
pub mod fuzzed;
pub mod passthrough;
pub mod security;

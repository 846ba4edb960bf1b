//! Settings that cannot crash it: the real binary refuses zero and
//! overflowing durations with a clear message before doing anything.
use std::process::Command;

fn run(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_cozy-proxy"))
        .args(args)
        .output()
        .expect("cozy-proxy runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn zero_and_overflowing_durations_are_refused() {
    for (flag, value, needle) in [
        ("--resync", "0s", "too short"),
        ("--poll-interval", "0ms", "too short"),
        ("--counters-interval", "0", "too short"),
        ("--resync", "307445734561825861m", "too long"),
        ("--debounce", "25h", "invalid duration unit"),
        ("--debounce", "1441m", "at most 24h"),
    ] {
        let (code, err) = run(&["run", "--manifests", "/nonexistent", flag, value]);
        // clap's usage error.
        assert_eq!(code, 2, "{flag} {value}: {err}");
        assert!(err.contains(needle), "{flag} {value}: {err}");
        assert!(err.contains(flag), "{flag} {value} not named: {err}");
    }
}

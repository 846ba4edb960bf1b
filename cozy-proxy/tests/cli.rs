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

/// Boolean flags take the bare form as well as `=true` / `=false`; a
/// manifest directory that does not exist stops the start with its name.
#[test]
fn bare_boolean_flags_and_a_missing_manifest_directory() {
    for flags in [
        &["--fast-path"][..],
        &["--fast-path=true"],
        &["--fast-path=false"],
        &["--derive-cluster-cidrs", "--fast-path"],
        &["--derive-cluster-cidrs=false"],
    ] {
        let mut args = vec!["run", "--manifests", "/nonexistent-manifests"];
        args.extend_from_slice(flags);
        let (code, err) = run(&args);
        assert_eq!(code, 1, "{flags:?}: {err}");
        assert!(
            err.contains("--manifests /nonexistent-manifests: no such directory"),
            "{flags:?}: {err}"
        );
    }
    let (code, err) = run(&["run", "--manifests", "/tmp", "--fast-path=maybe"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--fast-path"), "{err}");
}

//! `cargo xtask test`: format, lint, the previous release's build, then
//! every test binary, tallied.
//!
//! The datapath scenario binaries, the migrations and the real API's
//! spend much of each test waiting (for a packet that must not arrive,
//! for a controller or an API server to settle, for MetalLB to move an
//! address), and run more tests at a time than the 2 cores. The counts
//! below are the fastest measured with the tools built (docs/testing.md):
//! the scenarios took 36 s at 8 threads, 28 s at 12 and 31 s at 16 for
//! their 111 `nft::v4::` tests, and 297 s in all at 12 (340 s at 8 in
//! the last whole run); the cluster scenarios 168 s at 6, 173 s at 8 and
//! 185 s at 12 (the verifier, loading the programs for every test, takes
//! half of an eBPF test's CPU); the real API's tests 176 s at 4, with the
//! CPU busy 94% of the time (each starts an API server, the CPU's
//! busiest moment); the migrations 179 s at 2 and 108 s at 4 (149 s at 4
//! under two busy loops, no loss bound crossed). Every other binary
//! keeps libtest's default (one per core): the real nodes above all,
//! whose lifecycle's loss limits assume a machine not loaded beyond that
//! (three real clusters at a time under two busy loops lost datagrams in
//! a backend switch); at 4 threads they took 148 s against 159-177 s at
//! 2.
use crate::{cargo, root, run};
use anyhow::{bail, Context, Result};
use std::process::{Command, Stdio};

/// Integration tests of `cozy-proxy` that run more tests at a time than
/// the cores, and how many.
const WAITING: &[(&str, &str)] = &[
    ("scenarios", "12"),
    ("cluster", "6"),
    ("real_api", "4"),
    ("migration", "4"),
];

pub fn test(extra: &[String]) -> Result<()> {
    run(cargo().args(["fmt", "--all", "--check"]))?;
    run(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    // The whole suite: the build the upgrade test runs is made before the
    // binaries run (a run of chosen tests leaves it to the upgrade test).
    if extra.is_empty() {
        run(cargo().args([
            "run",
            "-q",
            "-p",
            "cozy-proxy-testkit",
            "--bin",
            "previous-release",
        ]))?;
    }
    let mut totals = Totals::default();
    let mut failures = Vec::new();
    for mut cmd in invocations(extra)? {
        if let Err(e) = totals.run(&mut cmd) {
            failures.push(format!("{e:#}"));
        }
    }
    println!("tests: {} passed, {} failed", totals.passed, totals.failed);
    totals.print_failures();
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    Ok(())
}

/// The rootless tier: every crate's unit and property tests (the model,
/// the plan, the nft encoder and decoder, the sync layer over the fake
/// kernel, the controller over the fake API), but no integration test and
/// no unit test of a module's `kernel_tests`. It needs no setup and no
/// root: it builds without the eBPF object (no eBPF toolchain), into
/// target/unit so that the full build's artefacts stay as they are.
pub fn unit() -> Result<()> {
    let mut totals = Totals::default();
    let mut cmd = cargo();
    cmd.args(["test", "--workspace", "--lib", "--bins"])
        .args(["--", "--skip", "kernel_tests"])
        .env("COZY_PROXY_BUILD_EBPF", "0")
        .env("CARGO_TARGET_DIR", root().join("target/unit"));
    let ran = totals.run(&mut cmd);
    println!("tests: {} passed, {} failed", totals.passed, totals.failed);
    ran
}

/// The `cargo test` runs: with `extra` arguments, the one the caller
/// asked for; otherwise the whole workspace, split by [`WAITING`]. Each
/// run goes on past a failing binary, so that one run reports every
/// failure.
fn invocations(extra: &[String]) -> Result<Vec<Command>> {
    let base = || {
        let mut cmd = cargo();
        cmd.args(["test", "--no-fail-fast"]);
        cmd
    };
    if !extra.is_empty() {
        let mut cmd = base();
        cmd.arg("--workspace").args(extra);
        return Ok(vec![cmd]);
    }
    let mut rest = base();
    rest.args(["--workspace", "--exclude", "cozy-proxy"]);
    let mut ours = base();
    ours.args(["-p", "cozy-proxy", "--lib", "--bins"]);
    // One run per thread count.
    let mut waiting: Vec<(&str, Command)> = Vec::new();
    for name in integration_tests()? {
        match WAITING.iter().find(|(n, _)| *n == name) {
            None => {
                ours.args(["--test", &name]);
            }
            Some(&(_, threads)) => {
                if !waiting.iter().any(|(t, _)| *t == threads) {
                    let mut cmd = base();
                    cmd.args(["-p", "cozy-proxy"]);
                    waiting.push((threads, cmd));
                }
                if let Some((_, cmd)) = waiting.iter_mut().find(|(t, _)| *t == threads) {
                    cmd.args(["--test", &name]);
                }
            }
        }
    }
    let mut all = vec![rest, ours];
    for (threads, mut cmd) in waiting {
        cmd.args(["--", "--test-threads", threads]);
        all.push(cmd);
    }
    Ok(all)
}

/// The names of `cozy-proxy/tests/*.rs`.
fn integration_tests() -> Result<Vec<String>> {
    let dir = root().join("cozy-proxy/tests");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "rs") {
            if let Some(stem) = path.file_stem().and_then(|s| s.to_str()) {
                names.push(stem.to_string());
            }
        }
    }
    names.sort();
    for (name, _) in WAITING {
        if !names.iter().any(|n| n == name) {
            bail!("cozy-proxy/tests/{name}.rs is named in WAITING but missing");
        }
    }
    Ok(names)
}

/// Passed and failed tests over every `cargo test` run, read from the
/// output as it passes through.
#[derive(Default)]
struct Totals {
    passed: u64,
    failed: u64,
    /// What each failing test printed, as [`FailureReports`] keeps it.
    reports: FailureReports,
}

/// The lines most of a failing test's report fits in: a CI log keeps its
/// end, and every failure's cause is to be read there.
const REPORT_LINES: usize = 80;

/// The `---- <test> stdout ----` sections of libtest's output, without
/// the frames of stack backtraces, each cut at [`REPORT_LINES`].
#[derive(Default)]
struct FailureReports {
    done: Vec<Vec<String>>,
    current: Option<Vec<String>>,
    in_backtrace: bool,
}

impl FailureReports {
    fn read(&mut self, line: &str) {
        if line.starts_with("---- ") && line.ends_with(" ----") {
            self.close();
            self.current = Some(vec![line.to_string()]);
            return;
        }
        let Some(report) = self.current.as_mut() else {
            return;
        };
        if line == "failures:" || line.starts_with("test result: ") {
            self.close();
            return;
        }
        if line.trim() == "Stack backtrace:" {
            self.in_backtrace = true;
            return;
        }
        if self.in_backtrace {
            if line.trim().is_empty() {
                self.in_backtrace = false;
            }
            return;
        }
        if report.len() < REPORT_LINES {
            report.push(line.to_string());
        } else if report.len() == REPORT_LINES {
            report.push("[... cut]".to_string());
        }
    }

    fn close(&mut self) {
        self.in_backtrace = false;
        if let Some(report) = self.current.take() {
            self.done.push(report);
        }
    }
}

impl Totals {
    fn run(&mut self, cmd: &mut Command) -> Result<()> {
        use std::io::{BufRead, BufReader};
        cmd.stdout(Stdio::piped());
        eprintln!("xtask: {cmd:?}");
        let mut child = cmd.spawn().context("cargo test")?;
        if let Some(out) = child.stdout.take() {
            for line in BufReader::new(out).lines() {
                let line = line?;
                println!("{line}");
                self.reports.read(&line);
                if let Some((p, f)) = tally(&line) {
                    self.passed += p;
                    self.failed += f;
                }
            }
        }
        let status = child.wait()?;
        if !status.success() {
            bail!("{cmd:?} failed: {status}");
        }
        Ok(())
    }

    /// Every failing test's report again, at the end of the output.
    fn print_failures(&mut self) {
        self.reports.close();
        if self.reports.done.is_empty() {
            return;
        }
        println!("\nthe failures' reports:");
        for report in &self.reports.done {
            for line in report {
                println!("{line}");
            }
        }
    }
}

/// `(passed, failed)` from a libtest line "test result: ok. 3 passed; 0 failed; ...".
fn tally(line: &str) -> Option<(u64, u64)> {
    let rest = line.strip_prefix("test result: ")?;
    let count = |word: &str| -> Option<u64> {
        rest.split(';')
            .find_map(|part| part.trim().strip_suffix(word))
            .and_then(|n| n.trim().rsplit(' ').next())
            .and_then(|n| n.parse().ok())
    };
    Some((count("passed")?, count("failed")?))
}

#[cfg(test)]
mod tests {
    #[test]
    fn tally_reads_libtest_summaries() {
        let line = "test result: ok. 80 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 98.55s";
        assert_eq!(super::tally(line), Some((80, 2)));
        assert_eq!(super::tally("test foo ... ok"), None);
    }

    #[test]
    fn failure_reports_keep_the_message_and_drop_the_frames() {
        let out = "\
test a ... FAILED
failures:

---- a stdout ----
Error: TCP timed out

Stack backtrace:
   0: anyhow::msg
             at src/lib.rs:1:1

the rest of a
---- b stdout ----
b's message

failures:
    a
    b

test result: FAILED. 0 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1s";
        let mut reports = super::FailureReports::default();
        for line in out.lines() {
            reports.read(line);
        }
        reports.close();
        assert_eq!(
            reports.done,
            vec![
                vec![
                    "---- a stdout ----",
                    "Error: TCP timed out",
                    "",
                    "the rest of a"
                ],
                vec!["---- b stdout ----", "b's message", ""],
            ]
        );
    }

    #[test]
    fn lists_the_integration_tests() {
        let names = super::integration_tests().expect("cozy-proxy/tests");
        for (name, _) in super::WAITING {
            assert!(names.iter().any(|n| n == name), "{name}");
        }
        assert!(names.iter().any(|n| n == "migration"));
    }

    /// Each waiting binary runs once, with its own thread count, and no
    /// other binary runs beside it.
    #[test]
    fn waiting_binaries_run_with_their_thread_counts() {
        let runs: Vec<String> = super::invocations(&[])
            .expect("the runs")
            .iter()
            .map(|c| format!("{:?}", c.get_args().collect::<Vec<_>>()))
            .collect();
        for (name, threads) in super::WAITING {
            let with: Vec<&String> = runs
                .iter()
                .filter(|r| r.contains(&format!("\"--test\", \"{name}\"")))
                .collect();
            assert_eq!(with.len(), 1, "{name} in {runs:#?}");
            assert!(
                with[0].ends_with(&format!("\"--test-threads\", \"{threads}\"]")),
                "{name}: {}",
                with[0]
            );
            assert!(!with[0].contains("real_nodes"), "{}", with[0]);
        }
    }
}

//! Running real tools (ip, nft, socat, ping, tcpdump, conntrack) inside
//! network namespaces.
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

/// Where `cargo xtask setup` puts a tool it builds: `$var` if set, else
/// `~/.cache/cozy-proxy/<name>` (the rule of xtask's `gotool::cache_dir`).
pub fn setup_cache(var: &str, name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os(var) {
        return PathBuf::from(dir);
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    PathBuf::from(home).join(".cache/cozy-proxy").join(name)
}

/// `ip netns exec NS ARGS...`, waiting for it; returns the output whatever
/// the exit status.
pub fn run_in(ns: &str, args: &[&str]) -> Result<Output> {
    Command::new("ip")
        .args(["netns", "exec", ns])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {args:?} in {ns}"))
}

/// Like [`run_in`], failing unless the command succeeds.
pub fn ok_in(ns: &str, args: &[&str]) -> Result<String> {
    let out = run_in(ns, args)?;
    if !out.status.success() {
        bail!(
            "{args:?} in {ns} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A host command (not in a namespace), failing unless it succeeds.
pub fn ok(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {args:?}"))?;
    if !out.status.success() {
        bail!(
            "{args:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A background process in a namespace, killed when dropped.
pub struct Proc {
    pub child: Child,
    /// The child leads a process group of its own, signalled whole: its
    /// forks go with it.
    group: bool,
}

impl Proc {
    pub fn spawn_in(ns: &str, args: &[&str], stdout: Stdio, stderr: Stdio) -> Result<Proc> {
        Proc::start(&in_ns(ns, args), stdout, stderr, false, &[])
    }

    /// Like [`Proc::spawn_in`], the kernel refusing the process the
    /// `bpf(2)` commands `refused` ([`crate::refuse`]); `group`: as
    /// [`Proc::spawn_group_in`] (a wrapper such as strace and what it runs
    /// are signalled together).
    pub fn spawn_refused_in(
        ns: &str,
        args: &[&str],
        (stdout, stderr): (Stdio, Stdio),
        group: bool,
        refused: &[u32],
    ) -> Result<Proc> {
        Proc::start(&in_ns(ns, args), stdout, stderr, group, refused)
    }

    /// Like [`Proc::spawn_in`], for a server that forks a child per
    /// client: the children are killed with it. (A socat UDP server's
    /// child outlived it holding the port, and the next server on that
    /// port could not bind.)
    pub fn spawn_group_in(ns: &str, args: &[&str], stdout: Stdio, stderr: Stdio) -> Result<Proc> {
        Proc::start(&in_ns(ns, args), stdout, stderr, true, &[])
    }

    /// A background process on the host (no namespace of its own).
    pub fn spawn(args: &[&str], stdout: Stdio, stderr: Stdio) -> Result<Proc> {
        Proc::start(args, stdout, stderr, false, &[])
    }

    fn start(
        args: &[&str],
        stdout: Stdio,
        stderr: Stdio,
        group: bool,
        refused: &[u32],
    ) -> Result<Proc> {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(args[0]);
        cmd.args(&args[1..])
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        if group {
            cmd.process_group(0);
        }
        if !refused.is_empty() {
            let filter = crate::controller::refuse::filter(refused);
            // SAFETY: the hook only makes prctl calls (async-signal-safe)
            // on a filter built before the fork.
            unsafe { cmd.pre_exec(move || crate::controller::refuse::install(&filter)) };
        }
        let child = cmd.spawn().with_context(|| format!("starting {args:?}"))?;
        Ok(Proc { child, group })
    }

    /// Still running?
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn kill(&mut self, signal: i32) {
        let pid = self.child.id() as i32;
        // SAFETY: plain kill(2) on our own child, or on the group it leads.
        unsafe {
            libc::kill(if self.group { -pid } else { pid }, signal);
        }
    }
}

/// `args` run in namespace `ns`.
fn in_ns<'a>(ns: &'a str, args: &[&'a str]) -> Vec<&'a str> {
    let mut all = vec!["ip", "netns", "exec", ns];
    all.extend_from_slice(args);
    all
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill(libc::SIGKILL);
        let _ = self.child.wait();
    }
}

/// Runs a command in a namespace with `input` on stdin, bounded by
/// `timeout_s` seconds (coreutils `timeout`); returns the output.
pub fn feed_in(ns: &str, args: &[&str], input: &[u8], timeout_s: u32) -> Result<Output> {
    use std::io::Write;
    let limit = timeout_s.to_string();
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "timeout", &limit])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {args:?} in {ns}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(input);
    }
    Ok(child.wait_with_output()?)
}

/// The last `n` lines of file `path` (empty if it cannot be read), for a
/// failure report.
pub fn tail(path: &std::path::Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

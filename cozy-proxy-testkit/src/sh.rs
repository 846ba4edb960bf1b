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

/// `ARGS...` run in namespace `ns`, waiting for it; returns the output
/// whatever the exit status.
pub fn run_in(ns: &str, args: &[&str]) -> Result<Output> {
    spawned_in(ns, args, |cmd| cmd.stdin(Stdio::null()).output())
        .with_context(|| format!("running {args:?} in {ns}"))
}

/// `run` given a command for `args` that runs in network namespace `ns`.
///
/// The tools the tests drive (ip, nft, sysctl, ethtool, socat, ping,
/// conntrack) see a namespace only through their sockets and /proc/sys,
/// which follow the process's network namespace. They are spawned from a
/// thread that entered `ns` (a child starts in its parent thread's
/// namespaces), by the same posix_spawn as any command: one process, and
/// no fork of the test's whole address space, as a `pre_exec` hook would
/// need. `ip netns exec` costs a second exec and a mount namespace with a
/// fresh /sys, half of a scenario's processes; it is kept where /sys is
/// read: by the product's binary (a device's driver) and by a command
/// that names a /sys path.
fn spawned_in<T: Send>(
    ns: &str,
    args: &[&str],
    run: impl FnOnce(&mut Command) -> std::io::Result<T> + Send,
) -> Result<T> {
    let Some((program, rest)) = args.split_first() else {
        bail!("no command to run in {ns}");
    };
    if reads_sysfs(args) {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns]).args(args);
        return Ok(run(&mut cmd)?);
    }
    in_netns(ns, || {
        let mut cmd = Command::new(program);
        cmd.args(rest);
        Ok(run(&mut cmd)?)
    })
}

/// Runs `f` on a thread in network namespace `ns` and returns what it
/// made: a socket made there stays there, whichever thread uses it next;
/// interface names are resolved there; BPF objects are not tied to a
/// namespace.
pub fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            enter_netns(ns)?;
            f()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the thread in {ns} panicked"))?
    })
}

/// Moves the calling thread into network namespace `ns` (sockets it makes
/// and processes it spawns then belong there; other threads stay where
/// they are).
pub fn enter_netns(ns: &str) -> Result<()> {
    use std::os::fd::AsRawFd;
    let path = format!("/run/netns/{ns}");
    let file = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    // SAFETY: setns on the calling thread only, into a namespace file we
    // hold open.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("setns {ns}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `args` read /sys, which shows a namespace's devices only
/// as `ip netns exec` mounts it: the product's binary (any release's,
/// named `cozy-proxy`, also behind a wrapper such as `timeout`) or a
/// command naming a /sys path.
fn reads_sysfs(args: &[&str]) -> bool {
    args.iter().any(|a| {
        a.starts_with("/sys/")
            || std::path::Path::new(a)
                .file_name()
                .is_some_and(|n| n == "cozy-proxy")
    })
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
    let mut timed = vec!["timeout", limit.as_str()];
    timed.extend_from_slice(args);
    spawned_in(ns, &timed, |cmd| {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(input);
        }
        child.wait_with_output()
    })
    .with_context(|| format!("running {args:?} in {ns}"))
}

/// The ids of every process now running (the numeric names in /proc).
pub fn process_ids() -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .collect()
}

/// The last `n` lines of file `path` (empty if it cannot be read), for a
/// failure report.
pub fn tail(path: &std::path::Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

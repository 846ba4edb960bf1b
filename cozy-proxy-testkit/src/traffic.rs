//! Real traffic: socat servers and clients, ping, tcpdump, conntrack.
use super::net::Fam;
use super::sh::{feed_in, ok_in, run_in, Proc};
use anyhow::{bail, Context, Result};
use std::{
    fs,
    net::IpAddr,
    path::PathBuf,
    process::Stdio,
    thread::sleep,
    time::{Duration, Instant},
};

/// Retries `f` until it succeeds or `timeout` passes; returns the last error.
pub fn eventually<T>(timeout: Duration, mut f: impl FnMut() -> Result<T>) -> Result<T> {
    let start = Instant::now();
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if start.elapsed() >= timeout => return Err(e),
            Err(_) => sleep(Duration::from_millis(100)),
        }
    }
}

/// How long a positive check may retry (covers the controller's poll and
/// the first ARP/ND round).
pub const SETTLE: Duration = Duration::from_secs(3);

fn socat_addr(kind: &str, ip: &IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(a) => format!("{kind}4:{a}:{port}"),
        IpAddr::V6(a) => format!("{kind}6:[{a}]:{port}"),
    }
}

/// A socat server that answers every TCP connection or UDP datagram with
/// `"<ident> <peer address>"`.
pub struct Server {
    _proc: Proc,
}

impl Server {
    pub fn tcp(ns: &str, fam: Fam, port: u16, ident: &str) -> Result<Server> {
        Self::start(ns, fam, "TCP", port, ident, None)
    }

    pub fn udp(ns: &str, fam: Fam, port: u16, ident: &str) -> Result<Server> {
        Self::start(ns, fam, "UDP", port, ident, None)
    }

    /// A UDP server bound to `addr`: its answers leave from `addr`, not
    /// from the address the route back to the client picks (a node's
    /// route to pods behind a router picks its join address).
    pub fn udp_at(ns: &str, addr: IpAddr, port: u16, ident: &str) -> Result<Server> {
        let fam = if addr.is_ipv4() { Fam::V4 } else { Fam::V6 };
        Self::start(ns, fam, "UDP", port, ident, Some(addr))
    }

    fn start(
        ns: &str,
        fam: Fam,
        proto: &str,
        port: u16,
        ident: &str,
        bind: Option<IpAddr>,
    ) -> Result<Server> {
        let v = if fam == Fam::V4 { "4" } else { "6" };
        let bind = bind.map_or(String::new(), |a| match a {
            IpAddr::V4(a) => format!(",bind={a}"),
            IpAddr::V6(a) => format!(",bind=[{a}]"),
        });
        let listen = if proto == "TCP" {
            format!("TCP{v}-LISTEN:{port},reuseaddr,fork")
        } else {
            format!("UDP{v}-RECVFROM:{port},fork{bind}")
        };
        // Over TCP the shell reads the request (a line, or up to the
        // client's half-close) before it answers: a shell that exited first
        // makes socat's write of the request fail (EPIPE), and the
        // connection closes unanswered, as a loaded machine's slow fork
        // often let happen.
        let reply = match proto {
            "TCP" => format!("SYSTEM:read request; echo {ident} $SOCAT_PEERADDR"),
            _ => format!("SYSTEM:echo {ident} $SOCAT_PEERADDR"),
        };
        let spawn = || {
            Proc::spawn_group_in(
                ns,
                &["socat", &listen, &reply],
                Stdio::null(),
                Stdio::null(),
            )
        };
        let ss_flag = if proto == "TCP" { "-Hltn" } else { "-Hlun" };
        let mut proc = spawn()?;
        eventually(Duration::from_secs(3), || {
            // A socket on the port is ours only while our server runs: one
            // that failed to bind (a dying server's fork still on it) is
            // started again.
            if !proc.alive() {
                proc = spawn()?;
                bail!("{proto} {port}: the server exited in {ns}; started again");
            }
            let out = ok_in(ns, &["ss", ss_flag, &format!("sport = :{port}")])?;
            if out.trim().is_empty() || !proc.alive() {
                bail!("{proto} {port} not listening in {ns}");
            }
            Ok(())
        })?;
        Ok(Server { _proc: proc })
    }
}

/// One TCP exchange from `ns` to `dst:port` (connect timeout 1 s): the
/// server's answer, or an error that says how it failed.
pub fn tcp_request(ns: &str, dst: IpAddr, port: u16) -> Result<String> {
    let target = format!("{},connect-timeout=1", socat_addr("TCP", &dst, port));
    let out = feed_in(
        ns,
        &["socat", "-T2", "-t2", "STDIO", &target],
        b"hello\n",
        4,
    )?;
    let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || stdout.is_empty() {
        bail!(
            "TCP {dst}:{port} from {ns}: {}, {:?}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(normalize(&stdout))
}

/// One TCP exchange from `ns` bound to `src:sport` (a chosen source
/// address and port).
pub fn tcp_request_from(
    ns: &str,
    src: IpAddr,
    sport: u16,
    dst: IpAddr,
    port: u16,
) -> Result<String> {
    let bind = match src {
        IpAddr::V4(a) => format!("{a}:{sport}"),
        IpAddr::V6(a) => format!("[{a}]:{sport}"),
    };
    let target = format!(
        "{},connect-timeout=1,bind={bind},reuseaddr",
        socat_addr("TCP", &dst, port)
    );
    let out = feed_in(
        ns,
        &["socat", "-T2", "-t2", "STDIO", &target],
        b"hello\n",
        4,
    )?;
    let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || stdout.is_empty() {
        bail!(
            "TCP {bind} -> {dst}:{port} from {ns}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(normalize(&stdout))
}

/// One UDP exchange (waits 1 s for the answer).
pub fn udp_request(ns: &str, dst: IpAddr, port: u16) -> Result<String> {
    let target = socat_addr("UDP", &dst, port);
    let out = feed_in(ns, &["socat", "-T1", "STDIO", &target], b"hello\n", 4)?;
    let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if stdout.is_empty() {
        bail!(
            "UDP {dst}:{port} from {ns}: no answer {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(normalize(&stdout))
}

/// A server's answer `"<ident> <peer>"`, as the checks compare it.
pub fn answer(ident: &str, peer: IpAddr) -> String {
    format!("{ident} {peer}")
}

/// socat prints IPv6 peers in full and in brackets; the checks compare
/// addresses, so bring the answer to [`answer`]'s form.
fn normalize(text: &str) -> String {
    let mut words = text.split_whitespace();
    match (words.next(), words.next(), words.next()) {
        (Some(ident), Some(peer), None) => {
            match peer
                .trim_start_matches('[')
                .trim_end_matches(']')
                .parse::<IpAddr>()
            {
                Ok(ip) => answer(ident, ip),
                Err(_) => text.to_string(),
            }
        }
        _ => text.to_string(),
    }
}

/// One echo request (1 s wait); Ok with the source of the reply.
pub fn ping(ns: &str, dst: IpAddr) -> Result<IpAddr> {
    let out = run_in(ns, &["ping", "-n", "-c1", "-W1", &dst.to_string()])?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("ping {dst} from {ns}: no reply");
    }
    // "64 bytes from 203.0.113.10: icmp_seq=1 ..." (IPv6 alike).
    let from = text
        .lines()
        .find_map(|l| l.split(" from ").nth(1))
        .and_then(|rest| rest.split(": ").next())
        .context("no reply line")?;
    from.parse()
        .with_context(|| format!("reply source in {text:?}"))
}

/// ICMP echo requests the namespace's stack has received.
pub fn echo_requests_received(ns: &str, fam: Fam) -> Result<u64> {
    let (file, key) = match fam {
        Fam::V4 => ("/proc/net/snmp", "InEchos"),
        Fam::V6 => ("/proc/net/snmp6", "Icmp6InEchos"),
    };
    let text = ok_in(ns, &["cat", file])?;
    if fam == Fam::V6 {
        return text
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse().ok())
            .context("Icmp6InEchos");
    }
    // Two "Icmp:" lines: names, then values.
    let mut icmp = text.lines().filter(|l| l.starts_with("Icmp:"));
    let names: Vec<&str> = icmp
        .next()
        .context("Icmp names")?
        .split_whitespace()
        .collect();
    let values: Vec<&str> = icmp
        .next()
        .context("Icmp values")?
        .split_whitespace()
        .collect();
    let i = names.iter().position(|n| *n == key).context("InEchos")?;
    values
        .get(i)
        .and_then(|v| v.parse().ok())
        .context("InEchos value")
}

/// Sends one raw IP datagram of `protocol` carrying `marker` from `ns`.
pub fn send_raw(ns: &str, dst: IpAddr, protocol: u8, marker: &str) -> Result<()> {
    let target = match dst {
        IpAddr::V4(a) => format!("IP4-SENDTO:{a}:{protocol}"),
        IpAddr::V6(a) => format!("IP6-SENDTO:[{a}]:{protocol}"),
    };
    let out = feed_in(ns, &["socat", "-u", "STDIN", &target], marker.as_bytes(), 3)?;
    if !out.status.success() {
        bail!("raw send: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// A raw IP receiver for one protocol, writing what it gets to a file.
pub struct RawReceiver {
    _proc: Proc,
    file: PathBuf,
}

impl RawReceiver {
    pub fn start(ns: &str, fam: Fam, protocol: u8, file: PathBuf) -> Result<RawReceiver> {
        let kind = if fam == Fam::V4 {
            "IP4-RECV"
        } else {
            "IP6-RECV"
        };
        let out = fs::File::create(&file)?;
        let proc = Proc::spawn_in(
            ns,
            &["socat", "-u", &format!("{kind}:{protocol}"), "STDOUT"],
            Stdio::from(out),
            Stdio::null(),
        )?;
        sleep(Duration::from_millis(300));
        Ok(RawReceiver { _proc: proc, file })
    }

    pub fn received(&self) -> String {
        String::from_utf8_lossy(&fs::read(&self.file).unwrap_or_default()).into_owned()
    }
}

/// tcpdump on one interface, for checks of what arrives where.
pub struct Capture {
    proc: Proc,
    out: PathBuf,
}

impl Capture {
    pub fn start(ns: &str, dev: &str, filter: &str, out: PathBuf) -> Result<Capture> {
        let err = out.with_extension("err");
        let proc = Proc::spawn_in(
            ns,
            &["tcpdump", "-n", "-l", "-Q", "in", "-i", dev, filter],
            Stdio::from(fs::File::create(&out)?),
            Stdio::from(fs::File::create(&err)?),
        )?;
        eventually(Duration::from_secs(3), || {
            let text = fs::read_to_string(&err).unwrap_or_default();
            if text.contains("listening on") {
                Ok(())
            } else {
                bail!("tcpdump in {ns} not ready: {text}")
            }
        })?;
        Ok(Capture { proc, out })
    }

    /// A capture written as pcap to `out` (whole frames, for
    /// [`crate::frames::read_pcap`]).
    pub fn start_pcap(ns: &str, dev: &str, filter: &str, out: PathBuf) -> Result<Capture> {
        let err = out.with_extension("err");
        let file = out.display().to_string();
        let proc = Proc::spawn_in(
            ns,
            &[
                // Immediate mode: without it, frames wait in the kernel's
                // ring for a block to fill or a second to pass, and a
                // capture stopped sooner misses them.
                "tcpdump",
                "-n",
                "-U",
                "--immediate-mode",
                "-s",
                "0",
                "-Q",
                "in",
                "-i",
                dev,
                "-w",
                &file,
                filter,
            ],
            Stdio::null(),
            Stdio::from(fs::File::create(&err)?),
        )?;
        eventually(Duration::from_secs(3), || {
            let text = fs::read_to_string(&err).unwrap_or_default();
            if text.contains("listening on") {
                Ok(())
            } else {
                bail!("tcpdump in {ns} not ready: {text}")
            }
        })?;
        Ok(Capture { proc, out })
    }

    /// Stops a pcap capture; the frames it saw.
    pub fn stop_frames(mut self) -> Result<Vec<Vec<u8>>> {
        self.proc.kill(libc::SIGINT);
        let _ = self.proc.child.wait();
        crate::frames::read_pcap(&self.out)
    }

    /// Stops the capture; the packet lines it printed.
    pub fn stop(mut self) -> Vec<String> {
        self.proc.kill(libc::SIGINT);
        let _ = self.proc.child.wait();
        fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect()
    }
}

/// conntrack entries in `ns` matching the `conntrack -L` filter `args`.
pub fn conntrack(ns: &str, fam: Fam, args: &[&str]) -> Result<Vec<String>> {
    let f = if fam == Fam::V4 { "ipv4" } else { "ipv6" };
    let mut all = vec!["conntrack", "-L", "-f", f];
    all.extend_from_slice(args);
    let out = run_in(ns, &all)?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect())
}

//! Real traffic through the kernel, and its counting: TCP and UDP servers
//! and clients, ping, tcpdump, conntrack (here); long-running flows
//! measured while the network changes under them (`flows`); streams kept
//! up across a change of the controller (`across`).
//!
//! What it does not model: load (the benchmarks measure rates); every
//! exchange here is a request and its answer, or a counted stream.
pub mod across;
pub mod flows;

use crate::nodes::net::Fam;
use crate::sh::in_netns;
use crate::sh::{feed_in, ok_in, run_in, Proc};
use anyhow::{bail, Context, Result};
use std::{
    fs,
    io::{ErrorKind, Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    path::PathBuf,
    process::Stdio,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::{sleep, JoinHandle},
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

/// A TCP server `spawn` starts in `ns`, returned once it listens on
/// `port` (a client connecting earlier is refused and gives up).
pub fn listening_tcp(ns: &str, port: u16, mut spawn: impl FnMut() -> Result<Proc>) -> Result<Proc> {
    let mut proc = spawn()?;
    eventually(Duration::from_secs(3), || {
        // A socket on the port is ours only while our server runs: one
        // that failed to bind (a dying server's fork still on it) is
        // started again.
        if !proc.alive() {
            proc = spawn()?;
            bail!("TCP {port}: the server exited in {ns}; started again");
        }
        let out = ok_in(ns, &["ss", "-Hltn", &format!("sport = :{port}")])?;
        if out.trim().is_empty() || !proc.alive() {
            bail!("TCP {port} not listening in {ns}");
        }
        Ok(())
    })?;
    Ok(proc)
}

/// A server that answers every TCP connection or UDP datagram with
/// `"<ident> <peer address>"`: socat for TCP, a thread for UDP.
pub struct Server {
    _running: Running,
}

/// What runs the server, held until the server is dropped.
enum Running {
    Socat { _proc: Proc },
    Udp { _thread: UdpAnswerer },
}

impl Server {
    pub fn tcp(ns: &str, fam: Fam, port: u16, ident: &str) -> Result<Server> {
        let v = if fam == Fam::V4 { "4" } else { "6" };
        let listen = format!("TCP{v}-LISTEN:{port},reuseaddr,fork");
        // The shell reads the request (a line, or up to the client's
        // half-close) before it answers: a shell that exited first makes
        // socat's write of the request fail (EPIPE), and the connection
        // closes unanswered. `-t5`: once the client has half-closed, socat
        // waits that long for the shell's answer (0.5 s by default, which a
        // loaded machine's fork and exec can take).
        let reply = format!("SYSTEM:read request; echo {ident} $SOCAT_PEERADDR");
        let spawn = || {
            Proc::spawn_group_in(
                ns,
                &["socat", "-t5", &listen, &reply],
                Stdio::null(),
                Stdio::null(),
            )
        };
        Ok(Server {
            _running: Running::Socat {
                _proc: listening_tcp(ns, port, spawn)?,
            },
        })
    }

    pub fn udp(ns: &str, fam: Fam, port: u16, ident: &str) -> Result<Server> {
        Self::udp_at(ns, unspecified(fam == Fam::V4), port, ident)
    }

    /// A UDP server bound to `addr`: its answers leave from `addr`, not
    /// from the address the route back to the client picks (a node's
    /// route to pods behind a router picks its join address).
    pub fn udp_at(ns: &str, addr: IpAddr, port: u16, ident: &str) -> Result<Server> {
        let at = SocketAddr::new(addr, port);
        let socket = eventually(Duration::from_secs(3), || {
            in_netns(ns, move || {
                UdpSocket::bind(at).with_context(|| format!("UDP server on {at}"))
            })
        })
        .with_context(|| format!("in {ns}"))?;
        Ok(Server {
            _running: Running::Udp {
                _thread: UdpAnswerer::start(socket, ident)?,
            },
        })
    }
}

/// A loop on a thread of its own, run until its holder is dropped: the
/// drop asks it to stop and waits for it (a server's port is free again
/// after). The loop body returns `false` to end early.
struct Looping {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Looping {
    fn spawn(mut turn: impl FnMut() -> bool + Send + 'static) -> Looping {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread =
            std::thread::spawn(move || while !stopped.load(Ordering::Relaxed) && turn() {});
        Looping {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Looping {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A UDP socket answered from a thread, each datagram at once: no process
/// is forked per datagram, so a loaded machine delays an answer by a
/// scheduling slice, not by a fork and exec.
struct UdpAnswerer {
    _looping: Looping,
}

impl UdpAnswerer {
    /// How often the thread looks at the stop flag.
    const POLL: Duration = Duration::from_millis(50);

    fn start(socket: UdpSocket, ident: &str) -> Result<UdpAnswerer> {
        socket.set_read_timeout(Some(Self::POLL))?;
        let ident = ident.to_string();
        let mut buf = [0u8; 2048];
        Ok(UdpAnswerer {
            _looping: Looping::spawn(move || {
                if let Ok((_, peer)) = socket.recv_from(&mut buf) {
                    let text = format!("{}\n", answer(&ident, peer.ip()));
                    // An answer the network refuses is the test's to see.
                    let _ = socket.send_to(text.as_bytes(), peer);
                }
                true
            }),
        })
    }
}

/// One TCP exchange from `ns` to `dst:port` (connect timeout 1 s): the
/// server's answer, or an error that says how it failed.
pub fn tcp_request(ns: &str, dst: IpAddr, port: u16) -> Result<String> {
    let target = format!("{},connect-timeout=1", socat_addr("TCP", &dst, port));
    tcp_exchange(ns, &target, &format!("TCP {dst}:{port}"))
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
    tcp_exchange(ns, &target, &format!("TCP {bind} -> {dst}:{port}"))
}

/// A line sent to socat's `target` from `ns` and the answer read back;
/// `what` names the exchange in the error.
fn tcp_exchange(ns: &str, target: &str, what: &str) -> Result<String> {
    let out = feed_in(ns, &["socat", "-T2", "-t2", "STDIO", target], b"hello\n", 4)?;
    let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || stdout.is_empty() {
        bail!(
            "{what} from {ns}: {}, {:?}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(normalize(&stdout))
}

/// How long one UDP exchange waits for its answer. The servers answer from
/// a thread at once; a retry (a new socket, so a new flow) is the caller's.
pub const UDP_ANSWER_WAIT: Duration = Duration::from_secs(1);

/// One UDP exchange from `ns`, from a new socket (a new flow), connected
/// to `dst:port` as a client's is: only an answer from there counts, and
/// an ICMP error about the datagram fails it with "refused". It waits
/// [`UDP_ANSWER_WAIT`] for the answer.
pub fn udp_request(ns: &str, dst: IpAddr, port: u16) -> Result<String> {
    let target = SocketAddr::new(dst, port);
    let wait = UDP_ANSWER_WAIT;
    let answer = in_netns(ns, move || {
        let socket = UdpSocket::bind(SocketAddr::new(unspecified(dst.is_ipv4()), 0))?;
        socket.connect(target)?;
        socket.send(b"hello\n")?;
        let mut buf = [0u8; 2048];
        let n = recv_within(&socket, &mut buf, wait)?;
        Ok(String::from_utf8_lossy(&buf[..n]).trim().to_string())
    });
    match answer {
        Ok(text) if !text.is_empty() => Ok(normalize(&text)),
        Ok(_) => bail!("UDP {target} from {ns}: an empty answer"),
        Err(e) => match e.downcast_ref::<std::io::Error>().map(|e| e.kind()) {
            Some(ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                bail!("UDP {target} from {ns}: no answer in {wait:?}")
            }
            _ => bail!("UDP {target} from {ns}: {e}"),
        },
    }
}

/// `count` datagrams of one UDP flow from `ns` to `dst:port` (one socket,
/// connected), `gap` apart, each answered within [`UDP_ANSWER_WAIT`]: a
/// flow that lasts, past its first packet (the kernel's redirects, for
/// one, are about established flows: `redirected_client`'s scenario).
pub fn udp_flow(ns: &str, dst: IpAddr, port: u16, count: usize, gap: Duration) -> Result<()> {
    let target = SocketAddr::new(dst, port);
    in_netns(ns, move || {
        let socket = UdpSocket::bind(SocketAddr::new(unspecified(dst.is_ipv4()), 0))?;
        socket.connect(target)?;
        let mut buf = [0u8; 2048];
        for i in 0..count {
            socket.send(b"hello\n")?;
            recv_within(&socket, &mut buf, UDP_ANSWER_WAIT).with_context(|| {
                format!("UDP {target} from {ns}: datagram {i} of one flow unanswered")
            })?;
            sleep(gap);
        }
        Ok(())
    })
}

/// One datagram from a connected `socket` within `wait`: its length, or
/// `WouldBlock`/`TimedOut` when none came. A receive under a socket
/// timeout ends early with `Interrupted` when a signal with a handler
/// reaches its thread, even under `SA_RESTART`, and on Linux when the
/// process is stopped and resumed, handler or not (signal(7)). Neither is
/// a verdict on the network, so it waits again for the time left.
fn recv_within(socket: &UdpSocket, buf: &mut [u8], wait: Duration) -> std::io::Result<usize> {
    let deadline = Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        socket.set_read_timeout(Some(left))?;
        match socket.recv(buf) {
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            got => return got,
        }
    }
}

/// The unspecified address of a family (bound to: every address).
fn unspecified(v4: bool) -> IpAddr {
    if v4 {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    }
}

/// A server's answer `"<ident> <peer>"`, as the checks compare it.
/// From `from`, a TCP and a UDP exchange with `to:port` both answer
/// `"<ident> <seen>"`: the server identified itself, and saw `seen` as
/// the source.
pub fn exchange(from: &str, to: IpAddr, port: u16, ident: &str, seen: IpAddr) -> Result<()> {
    let want = answer(ident, seen);
    let got = eventually(SETTLE, || tcp_request(from, to, port))?;
    anyhow::ensure!(
        got == want,
        "TCP {from} -> {to}:{port}: answer {got:?}, expected {want:?}"
    );
    let got = eventually(SETTLE, || udp_request(from, to, port))?;
    anyhow::ensure!(
        got == want,
        "UDP {from} -> {to}:{port}: answer {got:?}, expected {want:?}"
    );
    Ok(())
}

/// The HTTP status `url` answers from namespace `ns` within a second.
pub fn http_status(ns: &str, url: &str) -> Result<String> {
    let args = [
        "curl",
        "-sS",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--max-time",
        "1",
        url,
    ];
    crate::sh::ok_in(ns, &args).map(|code| code.trim().to_string())
}

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

/// What the XDP program on veth `dev` did with what it received, summed
/// over the receive queues (`ethtool -S`): (redirected, dropped).
pub fn xdp_verdicts(ns: &str, dev: &str) -> Result<(u64, u64)> {
    let text = ok_in(ns, &["ethtool", "-S", dev])?;
    let sum = |suffix: &str| -> u64 {
        (text.lines())
            .filter_map(|l| l.trim().split_once(':'))
            .filter(|(k, _)| k.starts_with("rx_queue_") && k.ends_with(suffix))
            .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
            .sum()
    };
    Ok((sum("_xdp_redirect"), sum("_xdp_drops")))
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
    /// Waits until tcpdump, its errors in `err`, says it listens.
    fn listening(ns: &str, err: &std::path::Path) -> Result<()> {
        eventually(Duration::from_secs(3), || {
            let text = fs::read_to_string(err).unwrap_or_default();
            if text.contains("listening on") {
                Ok(())
            } else {
                bail!("tcpdump in {ns} not ready: {text}")
            }
        })
    }

    pub fn start(ns: &str, dev: &str, filter: &str, out: PathBuf) -> Result<Capture> {
        let err = out.with_extension("err");
        let proc = Proc::spawn_in(
            ns,
            &["tcpdump", "-n", "-l", "-Q", "in", "-i", dev, filter],
            Stdio::from(fs::File::create(&out)?),
            Stdio::from(fs::File::create(&err)?),
        )?;
        Capture::listening(ns, &err)?;
        Ok(Capture { proc, out })
    }

    /// A capture written as pcap to `out` (whole frames, for
    /// [`crate::packets::frames::read_pcap`]).
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
        Capture::listening(ns, &err)?;
        Ok(Capture { proc, out })
    }

    /// Stops a pcap capture; the frames it saw.
    pub fn stop_frames(mut self) -> Result<Vec<Vec<u8>>> {
        self.proc.kill(libc::SIGINT);
        let _ = self.proc.child.wait();
        crate::packets::frames::read_pcap(&self.out)
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

/// A TCP server in `ns` on `port` that writes `bytes` zero bytes to each
/// connection and closes it: an answer larger than one packet, which a
/// narrower link on the path makes the sender's path MTU discovery
/// lower its segments for. Served from a thread until dropped.
pub struct LargeAnswer {
    _looping: Looping,
}

impl LargeAnswer {
    pub fn serve(ns: &str, fam: Fam, port: u16, bytes: usize) -> Result<LargeAnswer> {
        let any = unspecified(fam == Fam::V4);
        let listener = in_netns(ns, move || {
            let l = std::net::TcpListener::bind(SocketAddr::new(any, port))?;
            l.set_nonblocking(true)?;
            Ok(l)
        })?;
        let answer = Arc::new(vec![0u8; bytes]);
        let looping = Looping::spawn(move || match listener.accept() {
            Ok((mut conn, _)) => {
                let _ = conn.set_nonblocking(false);
                let _ = conn.set_write_timeout(Some(Duration::from_secs(10)));
                let answer = answer.clone();
                std::thread::spawn(move || {
                    let _ = conn.write_all(&answer);
                });
                true
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                sleep(Duration::from_millis(5));
                true
            }
            Err(_) => false,
        });
        Ok(LargeAnswer { _looping: looping })
    }
}

/// Connects from `ns` to `dst:port` and reads until the server closes or
/// `within` passes; the bytes read. A path that loses the answer's large
/// packets (an ICMP error about them dropped) leaves the count short.
pub fn fetch(ns: &str, dst: IpAddr, port: u16, within: Duration) -> Result<usize> {
    let mut conn = in_netns(ns, move || {
        Ok(std::net::TcpStream::connect_timeout(
            &SocketAddr::new(dst, port),
            Duration::from_secs(2),
        )?)
    })
    .with_context(|| format!("TCP {dst}:{port} from {ns}"))?;
    let deadline = Instant::now() + within;
    let mut got = 0;
    let mut buf = vec![0u8; 65536];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(got);
        }
        conn.set_read_timeout(Some(left))?;
        match conn.read(&mut buf) {
            Ok(0) => return Ok(got),
            Ok(n) => got += n,
            // A signal to the test process, not the network's verdict.
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Ok(got)
            }
            Err(e) => return Err(e).with_context(|| format!("reading {dst}:{port} from {ns}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::thread::JoinHandleExt;

    extern "C" fn ignore(_: libc::c_int) {}

    /// A signal that reaches the receiving thread mid-wait does not end
    /// the wait: the datagram sent after it is still received.
    #[test]
    fn a_signal_during_the_wait_is_not_a_lost_answer() -> Result<()> {
        // SAFETY: a handler that does nothing, installed with SA_RESTART
        // (as runtimes install theirs), for a signal nothing else here uses.
        let installed = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = ignore as *const () as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigaction(libc::SIGUSR2, &action, std::ptr::null_mut())
        };
        anyhow::ensure!(
            installed == 0,
            "sigaction: {}",
            std::io::Error::last_os_error()
        );
        let server = UdpSocket::bind("127.0.0.1:0")?;
        let client = UdpSocket::bind("127.0.0.1:0")?;
        client.connect(server.local_addr()?)?;
        let client_addr = client.local_addr()?;
        let receiver = std::thread::spawn(move || {
            let mut buf = [0u8; 16];
            recv_within(&client, &mut buf, Duration::from_secs(3)).map(|n| buf[..n].to_vec())
        });
        sleep(Duration::from_millis(200));
        // SAFETY: the thread is alive: it waits up to 3 s for a datagram
        // not sent yet.
        let sent = unsafe { libc::pthread_kill(receiver.as_pthread_t(), libc::SIGUSR2) };
        anyhow::ensure!(sent == 0, "pthread_kill: {sent}");
        sleep(Duration::from_millis(200));
        server.send_to(b"answer", client_addr)?;
        let got = receiver
            .join()
            .map_err(|_| anyhow::anyhow!("the receiver panicked"))??;
        anyhow::ensure!(got == b"answer", "received {got:?}");
        Ok(())
    }
}

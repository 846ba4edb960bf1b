//! Long-running flows in network namespaces, measured while the network
//! changes under them: a UDP request/reply stream (what was answered, when,
//! and from which address) and held TCP connections (did they survive, how
//! long did they stall). Each runs on a thread of its own that entered the
//! namespace (a socket belongs to the namespace it was made in).
use crate::sh::enter_netns;
use anyhow::{Context, Result};
use std::{
    io::{BufRead, BufReader, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

fn any(v6: bool, port: u16) -> SocketAddr {
    match v6 {
        false => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
        true => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port),
    }
}

/// A thread that runs until stopped.
struct Running {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Running {
    /// Runs `body(stop)` on a thread in `ns`; `Ok` once the thread is in
    /// it and `body` set up what it needs (its sockets bound).
    fn start(
        ns: &str,
        body: impl FnOnce(Arc<AtomicBool>, &dyn Fn(Result<()>)) + Send + 'static,
    ) -> Result<Running> {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let (ns, flag) = (ns.to_string(), stop.clone());
        let thread = std::thread::spawn(move || {
            if let Err(e) = enter_netns(&ns) {
                let _ = tx.send(Err(e));
                return;
            }
            let ready = move |r: Result<()>| {
                let _ = tx.send(r);
            };
            body(flag, &ready);
        });
        rx.recv_timeout(Duration::from_secs(5))
            .context("the flow's thread did not start")??;
        Ok(Running {
            stop,
            thread: Some(thread),
        })
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop();
    }
}

const POLL: Duration = Duration::from_millis(50);

/// A UDP server that answers each datagram with `"<its text> <ident>
/// <peer address>"`, and a TCP server that answers each line the same way,
/// on one port, in one namespace.
pub struct Echo {
    _udp: Running,
    _tcp: Running,
}

impl Echo {
    pub fn start(ns: &str, v6: bool, port: u16, ident: &str) -> Result<Echo> {
        let id = ident.to_string();
        let udp = Running::start(ns, move |stop, ready| {
            let sock = match UdpSocket::bind(any(v6, port)) {
                Ok(s) => s,
                Err(e) => return ready(Err(e.into())),
            };
            let _ = sock.set_read_timeout(Some(POLL));
            ready(Ok(()));
            let mut buf = [0u8; 512];
            while !stop.load(Ordering::Relaxed) {
                if let Ok((n, peer)) = sock.recv_from(&mut buf) {
                    let text = String::from_utf8_lossy(&buf[..n]);
                    let reply = format!("{} {id} {}", text.trim(), peer.ip());
                    let _ = sock.send_to(reply.as_bytes(), peer);
                }
            }
        })?;
        let id = ident.to_string();
        let tcp = Running::start(ns, move |stop, ready| {
            let listener = match TcpListener::bind(any(v6, port)) {
                Ok(l) => l,
                Err(e) => return ready(Err(e.into())),
            };
            let _ = listener.set_nonblocking(true);
            ready(Ok(()));
            while !stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, peer)) => {
                        let (id, stop) = (id.clone(), stop.clone());
                        std::thread::spawn(move || serve_lines(conn, peer, &id, &stop));
                    }
                    Err(_) => std::thread::sleep(POLL),
                }
            }
        })?;
        Ok(Echo {
            _udp: udp,
            _tcp: tcp,
        })
    }
}

fn serve_lines(conn: TcpStream, peer: SocketAddr, id: &str, stop: &AtomicBool) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_read_timeout(Some(POLL));
    let Ok(mut out) = conn.try_clone() else {
        return;
    };
    let mut lines = BufReader::new(conn);
    let mut line = String::new();
    while !stop.load(Ordering::Relaxed) {
        match lines.read_line(&mut line) {
            Ok(0) => return,
            Ok(_) => {
                let reply = format!("{} {id} {}\n", line.trim(), peer.ip());
                if out.write_all(reply.as_bytes()).is_err() {
                    return;
                }
                line.clear();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return,
        }
    }
}

/// One datagram of a [`UdpStream`].
#[derive(Clone, Debug)]
pub struct Datagram {
    pub sent: Instant,
    /// The answer's text and the address it came from.
    pub answer: Option<(String, IpAddr)>,
}

/// Datagrams sent to `dst:port` every `every`, each answer recorded.
pub struct UdpStream {
    running: Running,
    log: Arc<Mutex<Vec<Datagram>>>,
    /// Cleared to stop sending while answers are still received.
    sending: Arc<AtomicBool>,
}

impl UdpStream {
    pub fn start(ns: &str, dst: IpAddr, port: u16, every: Duration) -> Result<UdpStream> {
        let log: Arc<Mutex<Vec<Datagram>>> = Arc::new(Mutex::default());
        let records = log.clone();
        let sending = Arc::new(AtomicBool::new(true));
        let send = sending.clone();
        let running = Running::start(ns, move |stop, ready| {
            let sock = match UdpSocket::bind(any(dst.is_ipv6(), 0)) {
                Ok(s) => s,
                Err(e) => return ready(Err(e.into())),
            };
            let _ = sock.set_read_timeout(Some(Duration::from_millis(2)));
            ready(Ok(()));
            let to = SocketAddr::new(dst, port);
            let mut next = Instant::now();
            let mut buf = [0u8; 512];
            while !stop.load(Ordering::Relaxed) {
                if send.load(Ordering::Relaxed) && Instant::now() >= next {
                    let mut log = records.lock().unwrap_or_else(|e| e.into_inner());
                    let seq = log.len();
                    // A send refused (no route for a moment) is a loss.
                    let _ = sock.send_to(format!("{seq}").as_bytes(), to);
                    log.push(Datagram {
                        sent: Instant::now(),
                        answer: None,
                    });
                    next += every;
                }
                if let Ok((n, from)) = sock.recv_from(&mut buf) {
                    let text = String::from_utf8_lossy(&buf[..n]).to_string();
                    let seq = text.split(' ').next().and_then(|s| s.parse::<usize>().ok());
                    let mut log = records.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(d) = seq.and_then(|s| log.get_mut(s)) {
                        d.answer = Some((text, from.ip()));
                    }
                }
            }
        })?;
        Ok(UdpStream {
            running,
            log,
            sending,
        })
    }

    /// Sends no more (answers are still taken).
    pub fn stop_sending(&self) {
        self.sending.store(false, Ordering::Relaxed);
    }

    /// Stops sending, waits `linger` for the last answers, and returns
    /// every datagram.
    pub fn finish(mut self, linger: Duration) -> Vec<Datagram> {
        self.stop_sending();
        std::thread::sleep(linger);
        self.running.stop();
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        log.clone()
    }
}

/// What became of a [`HeldTcp`] connection.
#[derive(Clone, Debug, Default)]
pub struct Held {
    /// Lines answered.
    pub answered: usize,
    /// The longest time between two answers, and when it ended.
    pub longest_stall: Duration,
    pub stall_ended: Option<Instant>,
    /// The answers' last word: the address the far end saw.
    pub seen: Option<String>,
    /// Why the connection ended before it was stopped.
    pub broken: Option<String>,
}

/// One TCP connection to `dst:port`, a line written every `every` and its
/// answer awaited.
pub struct HeldTcp {
    running: Running,
    state: Arc<Mutex<Held>>,
}

impl HeldTcp {
    pub fn start(ns: &str, dst: IpAddr, port: u16, every: Duration) -> Result<HeldTcp> {
        let state: Arc<Mutex<Held>> = Arc::default();
        let held = state.clone();
        let running = Running::start(ns, move |stop, ready| {
            let to = SocketAddr::new(dst, port);
            let conn = match TcpStream::connect_timeout(&to, Duration::from_secs(3)) {
                Ok(c) => c,
                Err(e) => return ready(Err(anyhow::anyhow!("connecting to {to}: {e}"))),
            };
            let _ = conn.set_read_timeout(Some(POLL));
            let Ok(mut out) = conn.try_clone() else {
                return ready(Err(anyhow::anyhow!("cloning the connection")));
            };
            ready(Ok(()));
            let mut lines = BufReader::new(conn);
            let (mut last, mut line, mut n) = (Instant::now(), String::new(), 0u64);
            let mut next = Instant::now();
            let fail = |why: String| {
                held.lock().unwrap_or_else(|e| e.into_inner()).broken = Some(why);
            };
            while !stop.load(Ordering::Relaxed) {
                if Instant::now() >= next {
                    if let Err(e) = out.write_all(format!("{n}\n").as_bytes()) {
                        return fail(format!("write: {e}"));
                    }
                    n += 1;
                    next += every;
                }
                match lines.read_line(&mut line) {
                    Ok(0) => return fail("closed by the far end".into()),
                    Ok(_) if line.ends_with('\n') => {
                        let mut h = held.lock().unwrap_or_else(|e| e.into_inner());
                        h.answered += 1;
                        if last.elapsed() > h.longest_stall {
                            h.longest_stall = last.elapsed();
                            h.stall_ended = Some(Instant::now());
                        }
                        h.seen = line.split_whitespace().last().map(str::to_string);
                        last = Instant::now();
                        line.clear();
                    }
                    Ok(_) => {}
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) => {}
                    Err(e) => return fail(format!("read: {e}")),
                }
            }
            let mut h = held.lock().unwrap_or_else(|e| e.into_inner());
            h.longest_stall = h.longest_stall.max(last.elapsed());
        })?;
        Ok(HeldTcp { running, state })
    }

    /// Stops it and says what became of it.
    pub fn finish(mut self) -> Held {
        self.running.stop();
        let held = self.state.lock().unwrap_or_else(|e| e.into_inner());
        held.clone()
    }
}

//! A netlink socket: requests whose messages are acknowledged (each, in an
//! nf_tables batch; the last, in a batch of route changes) and dumps.
use super::wire::{
    attr_str, messages, Message, NLMSGERR_ATTR_MSG, NLMSG_DONE, NLMSG_ERROR, NLMSG_HDRLEN,
    NLM_F_ACK_TLVS, NLM_F_CAPPED, NLM_F_DUMP_INTR,
};
use std::{
    collections::HashMap,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    sync::atomic::{AtomicU32, AtomicU64, Ordering},
};
use tracing::debug;

const NETLINK_CAP_ACK: i32 = libc::NETLINK_CAP_ACK;
const NETLINK_EXT_ACK: i32 = libc::NETLINK_EXT_ACK;

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("netlink socket: {0}")]
    Io(#[from] io::Error),
    #[error("the kernel refused {what}: {source}{}", extack.as_deref().map(|m| format!(" ({m})")).unwrap_or_default())]
    Refused {
        what: String,
        source: io::Error,
        extack: Option<String>,
    },
    #[error("the kernel did not acknowledge {0} message(s)")]
    MissingAcks(usize),
    #[error("{0}: every dump was interrupted by changes (NLM_F_DUMP_INTR); try again later")]
    Interrupted(String),
    #[error("this kernel has no {0}")]
    Missing(String),
}

impl crate::datapath::ErrorKind for NetlinkError {
    fn kind(&self) -> &'static str {
        match self {
            NetlinkError::Io(_) => "netlink_socket",
            NetlinkError::Refused { .. } => "refused",
            NetlinkError::MissingAcks(_) => "missing_acks",
            NetlinkError::Interrupted(_) => "interrupted",
            NetlinkError::Missing(_) => "missing",
        }
    }
}

impl NetlinkError {
    /// The errno the kernel answered, if it answered one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            NetlinkError::Refused { source, .. } => source.raw_os_error(),
            NetlinkError::Io(e) => e.raw_os_error(),
            NetlinkError::MissingAcks(_)
            | NetlinkError::Interrupted(_)
            | NetlinkError::Missing(_) => None,
        }
    }
}

static SEQ: AtomicU32 = AtomicU32::new(1);

/// A fresh sequence number for a message.
pub fn next_seq() -> u32 {
    SEQ.fetch_add(1, Ordering::Relaxed)
}

pub struct NlSocket {
    fd: OwnedFd,
}

/// Which messages of a request ask for an acknowledgement (NLM_F_ACK).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acked {
    Every,
    /// Only the last. The kernel answers a message that fails whether or
    /// not it asked (`netlink_rcv_skb`), and rtnetlink handles a request's
    /// messages in order, inside sendmsg(): the last one's answer comes
    /// after every earlier failure's. A route change each acknowledged was
    /// 30% of the time of 50 000 host routes (the kernel making, and we
    /// reading, an answer per route).
    Last,
}

impl Acked {
    /// The flag the `i`th of `n` messages carries.
    pub fn flag(self, i: usize, n: usize) -> u16 {
        match self {
            Acked::Last if i + 1 < n => 0,
            _ => super::wire::NLM_F_ACK,
        }
    }
}

fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

impl NlSocket {
    /// A socket that receives the multicast `groups` (e.g. RTMGRP_LINK), for
    /// [`NlSocket::pending_events`].
    pub fn subscribe(protocol: i32, groups: u32) -> Result<Self, NetlinkError> {
        Self::open_bound(protocol, groups)
    }

    /// `protocol`: `libc::NETLINK_NETFILTER`, `libc::NETLINK_ROUTE`, ...
    /// Bound at once (the kernel picks the port), so that
    /// [`NlSocket::port`] is known before the first request.
    pub fn open(protocol: i32) -> Result<Self, NetlinkError> {
        Self::open_bound(protocol, 0)
    }

    fn open_bound(protocol: i32, groups: u32) -> Result<Self, NetlinkError> {
        let sock = Self::open_unbound(protocol)?;
        // SAFETY: zeroed sockaddr_nl, then the fields we set.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as u16;
        addr.nl_groups = groups;
        // SAFETY: valid address and length.
        unsafe {
            check(libc::bind(
                sock.fd.as_raw_fd(),
                &addr as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            ))?;
        }
        Ok(sock)
    }

    /// Joins or leaves multicast group `group` (a group number, as
    /// `libc::NFNLGRP_NFTABLES`; not a mask).
    pub fn set_membership(&self, group: u32, member: bool) -> Result<(), NetlinkError> {
        let opt = if member {
            libc::NETLINK_ADD_MEMBERSHIP
        } else {
            libc::NETLINK_DROP_MEMBERSHIP
        };
        Ok(self.setsockopt(libc::SOL_NETLINK, opt, group as libc::c_int)?)
    }

    /// Drains the notifications waiting on a subscribed socket, counting
    /// those `relevant` says matter; an overrun (lost notifications) counts
    /// as one: something may have changed.
    pub fn pending_events(
        &self,
        mut relevant: impl FnMut(&Message) -> bool,
    ) -> Result<usize, NetlinkError> {
        let mut buf = vec![0u8; 64 << 10];
        let mut count = 0;
        loop {
            match self.recv(&mut buf, true) {
                Ok(Some(n)) => count += messages(&buf[..n]).filter(|m| relevant(m)).count(),
                Ok(None) => return Ok(count),
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => count += 1,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Blocks until a notification (or an overrun) arrives, then drains
    /// what is waiting: for a thread whose only job is to say "something
    /// happened".
    /// A quiet spell longer than the socket's receive timeout is not an
    /// error: it waits on.
    pub fn wait_event(&self) -> Result<(), NetlinkError> {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match self.recv(&mut buf, false) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.pending_events(|_| false).map(|_| ())
    }

    /// The netlink port the kernel gave this socket: the `pid` of the
    /// notifications of the changes it makes.
    pub fn port(&self) -> Result<u32, NetlinkError> {
        // SAFETY: zeroed sockaddr_nl, filled by getsockname.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t;
        // SAFETY: valid address buffer and length.
        unsafe {
            check(libc::getsockname(
                self.fd.as_raw_fd(),
                &mut addr as *mut _ as *mut libc::sockaddr,
                &mut len,
            ))?;
        }
        Ok(addr.nl_pid)
    }

    fn open_unbound(protocol: i32) -> Result<Self, NetlinkError> {
        // SAFETY: plain syscalls on a descriptor we own.
        let fd = unsafe {
            check(libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                protocol,
            ))?
        };
        // SAFETY: fd was just returned by socket().
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let sock = NlSocket { fd };
        // Large batches (tens of thousands of elements) and their acks must
        // fit: ask for big buffers (the FORCE variants work as root).
        for opt in [libc::SO_SNDBUFFORCE, libc::SO_RCVBUFFORCE] {
            let size: libc::c_int = 64 << 20;
            if sock.setsockopt(libc::SOL_SOCKET, opt, size).is_err() {
                let plain = if opt == libc::SO_SNDBUFFORCE {
                    libc::SO_SNDBUF
                } else {
                    libc::SO_RCVBUF
                };
                sock.setsockopt(libc::SOL_SOCKET, plain, size)?;
            }
        }
        // Errors echo only the header, plus the kernel's explanation.
        sock.setsockopt(libc::SOL_NETLINK, NETLINK_CAP_ACK, 1)?;
        let _ = sock.setsockopt(libc::SOL_NETLINK, NETLINK_EXT_ACK, 1);
        let timeout = libc::timeval {
            tv_sec: 10,
            tv_usec: 0,
        };
        // SAFETY: valid pointer and length for SO_RCVTIMEO.
        unsafe {
            check(libc::setsockopt(
                sock.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &timeout as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as u32,
            ))?;
        }
        Ok(sock)
    }

    /// Asks the kernel to check this socket's requests strictly
    /// (`NETLINK_GET_STRICT_CHK`): only then does it read a dump's
    /// filters, such as another namespace's id.
    pub fn check_strictly(&self) -> Result<(), NetlinkError> {
        const NETLINK_GET_STRICT_CHK: libc::c_int = 12;
        self.setsockopt(libc::SOL_NETLINK, NETLINK_GET_STRICT_CHK, 1)
            .map_err(NetlinkError::Io)
    }

    fn setsockopt(&self, level: i32, opt: i32, value: libc::c_int) -> io::Result<()> {
        // SAFETY: valid pointer and length for an int option.
        unsafe {
            check(libc::setsockopt(
                self.fd.as_raw_fd(),
                level,
                opt,
                &value as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as u32,
            ))?;
        }
        Ok(())
    }

    fn send(&self, bytes: &[u8]) -> io::Result<()> {
        // SAFETY: zeroed sockaddr_nl is the kernel's address (pid 0).
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: buffer and address are valid for the call.
        let n = unsafe {
            check(libc::sendto(
                self.fd.as_raw_fd(),
                bytes.as_ptr() as *const libc::c_void,
                bytes.len(),
                0,
                &addr as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            ) as libc::c_int)?
        };
        if n as usize != bytes.len() {
            return Err(io::Error::other("short netlink send"));
        }
        Ok(())
    }

    /// Receives one datagram; `Ok(None)` when nothing is waiting and
    /// `nonblocking` is set.
    fn recv(&self, buf: &mut [u8], nonblocking: bool) -> io::Result<Option<usize>> {
        let flags = if nonblocking { libc::MSG_DONTWAIT } else { 0 };
        // SAFETY: buf is valid for writes of its length.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                flags,
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            if nonblocking && err.kind() == io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(err);
        }
        Ok(Some(n as usize))
    }

    /// Sends `bytes` (one or more messages) and checks the acknowledgement
    /// of every message in `pending` (sequence number, what it does).
    pub fn transact(&self, bytes: &[u8], pending: Vec<(u32, String)>) -> Result<(), NetlinkError> {
        let seqs: Vec<u32> = pending.iter().map(|(seq, _)| *seq).collect();
        self.transact_described(bytes, &seqs, Acked::Every, |i| pending[i].1.clone())
    }

    /// As [`NlSocket::transact`], with the `i`th message of `seqs` told by
    /// `what(i)` only if it fails: a full sync sends tens of thousands of
    /// messages, and a description each was megabytes held for nothing.
    /// `acked`: which messages asked for an acknowledgement.
    pub fn transact_described(
        &self,
        bytes: &[u8],
        seqs: &[u32],
        acked: Acked,
        what: impl Fn(usize) -> String,
    ) -> Result<(), NetlinkError> {
        self.transact_tolerating(bytes, seqs, acked, what, |_| false)
            .map(|_| ())
    }

    /// As [`NlSocket::transact_described`], except that a message refused
    /// with an errno `tolerated` accepts is no failure: the indices of
    /// those messages are returned (the others went through).
    pub fn transact_tolerating(
        &self,
        bytes: &[u8],
        seqs: &[u32],
        acked: Acked,
        what: impl Fn(usize) -> String,
        tolerated: impl Fn(i32) -> bool,
    ) -> Result<Vec<usize>, NetlinkError> {
        let Some(&last) = seqs.last() else {
            return Ok(Vec::new());
        };
        self.send(bytes)?;
        // The kernel handles the request inside sendmsg(): every answer is
        // queued by now. Wait for the first, then drain the rest.
        let mut pending: HashMap<u32, usize> =
            seqs.iter().enumerate().map(|(i, seq)| (*seq, i)).collect();
        let mut first_error: Option<NetlinkError> = None;
        let mut refused = Vec::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut nonblocking = false;
        // The answers still awaited: every message's, or the last one's (an
        // answered message leaves `pending`).
        let awaited = |pending: &HashMap<u32, usize>| match acked {
            Acked::Every => pending.len(),
            Acked::Last => usize::from(pending.contains_key(&last)),
        };
        while awaited(&pending) > 0 {
            let Some(n) = self.recv(&mut buf, nonblocking)? else {
                break;
            };
            nonblocking = true;
            for msg in messages(&buf[..n]) {
                if msg.msg_type != NLMSG_ERROR {
                    continue;
                }
                let Some(i) = pending.remove(&msg.seq) else {
                    continue;
                };
                match parse_error(&msg) {
                    Some((errno, _)) if tolerated(errno) => refused.push(i),
                    Some((errno, extack)) if first_error.is_none() => {
                        first_error = Some(NetlinkError::Refused {
                            what: what(i),
                            source: io::Error::from_raw_os_error(errno),
                            extack,
                        });
                    }
                    _ => {}
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        match awaited(&pending) {
            0 => Ok(refused),
            missing => Err(NetlinkError::MissingAcks(missing)),
        }
    }

    /// Sends `bytes`: requests that each get exactly one answer (sent
    /// without NLM_F_ACK: the answer, or an error), with sequence numbers
    /// `seqs`; returns, by sequence number, the answer's payload or the
    /// errno. Many requests per sendmsg, each answer matched to its own.
    pub fn requests(
        &self,
        bytes: &[u8],
        seqs: &[u32],
    ) -> Result<HashMap<u32, Result<Vec<u8>, i32>>, NetlinkError> {
        let mut out = HashMap::with_capacity(seqs.len());
        if seqs.is_empty() {
            return Ok(out);
        }
        let wanted: std::collections::HashSet<u32> = seqs.iter().copied().collect();
        self.send(bytes)?;
        let mut buf = vec![0u8; 1 << 20];
        while out.len() < wanted.len() {
            let n = self.recv(&mut buf, false)?.unwrap_or(0);
            for m in messages(&buf[..n]) {
                if !wanted.contains(&m.seq) {
                    continue;
                }
                let answer = match m.msg_type {
                    NLMSG_ERROR => match parse_error(&m) {
                        Some((errno, _)) => Err(errno),
                        None => continue,
                    },
                    _ => Ok(m.payload.to_vec()),
                };
                out.insert(m.seq, answer);
            }
        }
        Ok(out)
    }

    /// Sends a dump request (one message, sequence number `seq`) and returns
    /// the payload (after nlmsghdr) of every answer. A dump the kernel marks
    /// interrupted (NLM_F_DUMP_INTR: the table changed while it was read)
    /// is made again, up to [`DUMP_ATTEMPTS`] times.
    pub fn dump(&self, request: &[u8], seq: u32, what: &str) -> Result<Vec<Vec<u8>>, NetlinkError> {
        for attempt in 1..=DUMP_ATTEMPTS {
            let mut out = Vec::new();
            if !self.dump_each(request, seq, what, |p| out.push(p.to_vec()))? {
                return Ok(out);
            }
            INTERRUPTED_DUMPS.fetch_add(1, Ordering::Relaxed);
            debug!(what, attempt, "dump interrupted by a change; dumping again");
        }
        Err(NetlinkError::Interrupted(what.to_string()))
    }

    /// One dump, each answer's payload handed to `each` as it arrives (a
    /// table too large to hold twice, as conntrack's); returns whether the
    /// kernel marked it interrupted.
    pub fn dump_each(
        &self,
        request: &[u8],
        seq: u32,
        what: &str,
        mut each: impl FnMut(&[u8]),
    ) -> Result<bool, NetlinkError> {
        self.send(request)?;
        let mut interrupted = false;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = self.recv(&mut buf, false)?.unwrap_or(0);
            for m in messages(&buf[..n]) {
                if m.seq != seq {
                    continue;
                }
                interrupted |= m.flags & NLM_F_DUMP_INTR != 0;
                match m.msg_type {
                    NLMSG_DONE => return Ok(interrupted),
                    NLMSG_ERROR => match parse_error(&m) {
                        Some((errno, extack)) => {
                            return Err(NetlinkError::Refused {
                                what: what.to_string(),
                                source: io::Error::from_raw_os_error(errno),
                                extack,
                            })
                        }
                        None => return Ok(interrupted),
                    },
                    _ => each(m.payload),
                }
            }
        }
    }
}

/// Dumps made before an interrupted one is given up.
pub const DUMP_ATTEMPTS: u32 = 5;

/// Dumps the kernel marked interrupted (and this process made again),
/// since the start: exported as a metric; a steady rise means another
/// agent changes the same tables all the time.
static INTERRUPTED_DUMPS: AtomicU64 = AtomicU64::new(0);

pub fn interrupted_dumps() -> u64 {
    INTERRUPTED_DUMPS.load(Ordering::Relaxed)
}

/// `Some((errno, message))` for an NLMSG_ERROR that reports a failure,
/// `None` for a plain acknowledgement.
fn parse_error(msg: &Message<'_>) -> Option<(i32, Option<String>)> {
    let code = i32::from_ne_bytes(msg.payload.get(0..4)?.try_into().ok()?);
    if code == 0 {
        return None;
    }
    let extack = if msg.flags & NLM_F_ACK_TLVS != 0 {
        let orig_len = if msg.flags & NLM_F_CAPPED != 0 {
            NLMSG_HDRLEN
        } else {
            msg.payload
                .get(4..8)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_ne_bytes)
                .map_or(NLMSG_HDRLEN, |l| l as usize)
        };
        msg.payload
            .get(4 + super::wire::align4(orig_len)..)
            .and_then(|tlvs| attr_str(tlvs, NLMSGERR_ATTR_MSG))
    } else {
        None
    };
    Some((-code, extack))
}

//! Traffic kept up across a change of the controller (a backend switch, an
//! upgrade): a UDP request/reply stream at 100/s each way and a held TCP
//! connection each way, all through one mapped pod's LB IP; then how much
//! of it the change cost.
use crate::traffic::flows::{Datagram, Echo, Held, HeldTcp, UdpStream};
use crate::traffic::{eventually, udp_request, SETTLE};
use crate::Env;
use anyhow::{ensure, Result};
use std::{net::IpAddr, time::Duration};

/// The streams of one pod (pod 1 of `env`, mapped to `lb`, `port` open
/// both ways if it is filtered).
pub struct Streams {
    lb: IpAddr,
    inbound: UdpStream,
    outbound: UdpStream,
    held_in: HeldTcp,
    held_out: HeldTcp,
    _echo: (Echo, Echo),
}

/// What the change cost.
pub struct Crossing {
    pub sent_in: usize,
    pub lost_in: usize,
    pub sent_out: usize,
    pub lost_out: usize,
    pub held_in: Held,
    pub held_out: Held,
    /// The datagrams, for `ACROSS_DEBUG=1`.
    inbound: Vec<Datagram>,
    outbound: Vec<Datagram>,
    lb: IpAddr,
}

impl Streams {
    /// Starts them once a request each way is translated, and lets them
    /// run for a second: what is lost is the change's, not the start's.
    pub fn start(env: &Env, lb: IpAddr, port: u16) -> Result<Streams> {
        Streams::between(&env.topo.pod(1), &env.topo.ext(), env.net.ext, lb, port)
    }

    /// The same between the mapped pod in namespace `pod` and the outside
    /// in `ext` (its address `ext_ip`), on any topology.
    pub fn between(pod: &str, ext: &str, ext_ip: IpAddr, lb: IpAddr, port: u16) -> Result<Streams> {
        let (pod, ext) = (pod.to_string(), ext.to_string());
        let v6 = lb.is_ipv6();
        let echo = (
            Echo::start(&pod, v6, port, "pod")?,
            Echo::start(&ext, v6, port, "ext")?,
        );
        eventually(SETTLE, || {
            let out = udp_request(&pod, ext_ip, port)?;
            ensure!(out.ends_with(&format!(" {lb}")), "the far end saw {out:?}");
            udp_request(&ext, lb, port).map(|_| ())
        })?;
        let every = Duration::from_millis(10);
        let streams = Streams {
            lb,
            inbound: UdpStream::start(&ext, lb, port, every)?,
            outbound: UdpStream::start(&pod, ext_ip, port, every)?,
            held_in: HeldTcp::start(&ext, lb, port, Duration::from_millis(50))?,
            held_out: HeldTcp::start(&pod, ext_ip, port, Duration::from_millis(50))?,
            _echo: echo,
        };
        std::thread::sleep(Duration::from_secs(1));
        Ok(streams)
    }

    /// Stops them (the last answers awaited for half a second).
    pub fn finish(self) -> Crossing {
        // Both stop sending together; every datagram then has half a
        // second for its answer.
        self.inbound.stop_sending();
        self.outbound.stop_sending();
        let inbound = self.inbound.finish(Duration::from_millis(500));
        let outbound = self.outbound.finish(Duration::ZERO);
        let lb = self.lb;
        let count = |log: &[Datagram], ok: &dyn Fn(&Datagram) -> bool| {
            (log.len(), log.iter().filter(|d| !ok(d)).count())
        };
        let (sent_in, lost_in) = count(&inbound, &|d| answered_in(d, lb));
        let (sent_out, lost_out) = count(&outbound, &|d| answered_out(d, lb));
        Crossing {
            sent_in,
            lost_in,
            sent_out,
            lost_out,
            held_in: self.held_in.finish(),
            held_out: self.held_out.finish(),
            inbound,
            outbound,
            lb,
        }
    }
}

/// An inbound datagram was answered from the LB IP.
fn answered_in(d: &Datagram, lb: IpAddr) -> bool {
    d.answer.as_ref().is_some_and(|(_, from)| *from == lb)
}

/// An outbound datagram was answered, and the far end saw the LB IP.
fn answered_out(d: &Datagram, lb: IpAddr) -> bool {
    (d.answer.as_ref()).is_some_and(|(text, _)| text.ends_with(&format!(" {lb}")))
}

impl Crossing {
    pub fn report(&self) -> String {
        format!(
            "in {} of {} lost, out {} of {} lost; held in: stall {:?}, broken {:?}; \
             held out: stall {:?}, broken {:?}",
            self.lost_in,
            self.sent_in,
            self.lost_out,
            self.sent_out,
            self.held_in.longest_stall,
            self.held_in.broken,
            self.held_out.longest_stall,
            self.held_out.broken
        )
    }

    /// With `ACROSS_DEBUG=1`: when each lost datagram was sent, from the
    /// first one.
    pub fn print_losses(&self) {
        if std::env::var("ACROSS_DEBUG").is_err() {
            return;
        }
        let t0 = self.inbound.first().map(|d| d.sent);
        let lb = self.lb;
        for (what, log, ok) in [
            (
                "in",
                &self.inbound,
                answered_in as fn(&Datagram, IpAddr) -> bool,
            ),
            ("out", &self.outbound, answered_out),
        ] {
            for d in log.iter().filter(|d| !ok(d, lb)) {
                println!(
                    "lost {what} at {:?}: {:?}",
                    t0.map(|t| d.sent - t),
                    d.answer
                );
            }
        }
    }

    /// At most `max_lost` datagrams lost each way, both connections alive
    /// and never stalled for a second.
    pub fn check(&self, max_lost: usize) -> Result<()> {
        let report = self.report();
        ensure!(self.sent_in > 100 && self.sent_out > 100, "{report}");
        ensure!(
            self.lost_in <= max_lost && self.lost_out <= max_lost,
            "over {max_lost} lost: {report}"
        );
        for held in [&self.held_in, &self.held_out] {
            ensure!(held.broken.is_none() && held.answered > 0, "{report}");
            ensure!(held.longest_stall < Duration::from_secs(1), "{report}");
        }
        Ok(())
    }
}

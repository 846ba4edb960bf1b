//! The vocabulary the scenarios of cozy-proxy/tests/cases/README.md are
//! written in: Services put in place, servers in pods, and checks of what
//! reaches whom. The scenarios themselves are in cozy-proxy/tests/cases.
pub mod env;
pub mod suite;

use crate::{
    controller::manifests::{slice, Svc},
    traffic::{answer, eventually, ping, tcp_request, udp_request, Server, SETTLE},
    Env,
};
use anyhow::{bail, ensure, Result};
use std::net::IpAddr;

/// TCP port every pod serves in most scenarios.
pub const WEB: u16 = 8080;

impl Env {
    pub fn pod_ns(&self, i: usize) -> String {
        self.topo.pod(i)
    }

    pub fn pod_ip(&self, i: usize) -> IpAddr {
        self.net.pods[i - 1]
    }

    pub fn lb(&self, i: usize) -> IpAddr {
        self.net.lbs[i]
    }

    /// Writes a Service and its EndpointSlice (all endpoints ready).
    pub fn put_service(&self, svc: &Svc, pods: &[IpAddr]) -> Result<()> {
        let eps: Vec<(String, Option<bool>)> = pods.iter().map(|p| (p.to_string(), None)).collect();
        self.put_service_with(svc, &eps)
    }

    pub fn put_service_with(&self, svc: &Svc, endpoints: &[(String, Option<bool>)]) -> Result<()> {
        let held;
        let svc = match &self.api {
            Some(api) => {
                held = api.put_service(svc, self.net.address_type(), endpoints, &self.ctl.node)?;
                &held
            }
            None => svc,
        };
        self.dir.put(&svc.name, &svc.yaml())?;
        self.dir.put(
            &format!("{}-endpoints", svc.name),
            &slice(&svc.name, self.net.address_type(), endpoints),
        )
    }

    pub fn delete_service(&self, name: &str) -> Result<()> {
        if let Some(api) = &self.api {
            api.delete_service(name)?;
        }
        self.dir.remove(name)?;
        self.dir.remove(&format!("{name}-endpoints"))
    }

    /// A TCP server in pod `i` answering "pod{i} <peer>".
    pub fn serve_tcp(&self, i: usize, port: u16) -> Result<Server> {
        Server::tcp(&self.pod_ns(i), self.fam(), port, &format!("pod{i}"))
    }

    pub fn serve_udp(&self, i: usize, port: u16) -> Result<Server> {
        Server::udp(&self.pod_ns(i), self.fam(), port, &format!("pod{i}"))
    }

    /// ext connects to `dst:port` over TCP and pod `i` answers, seeing ext's
    /// own address (the client is not translated).
    pub fn tcp_reaches(&self, dst: IpAddr, port: u16, i: usize) -> Result<()> {
        let want = answer(&format!("pod{i}"), self.net.ext);
        let got = eventually(SETTLE, || tcp_request(&self.topo.ext(), dst, port))?;
        ensure!(
            got == want,
            "TCP {dst}:{port}: answer {got:?}, expected {want:?}"
        );
        Ok(())
    }

    pub fn udp_reaches(&self, dst: IpAddr, port: u16, i: usize) -> Result<()> {
        let want = answer(&format!("pod{i}"), self.net.ext);
        let got = eventually(SETTLE, || udp_request(&self.topo.ext(), dst, port))?;
        ensure!(
            got == want,
            "UDP {dst}:{port}: answer {got:?}, expected {want:?}"
        );
        Ok(())
    }

    /// ext's TCP connection to `dst:port` gets no answer at all: no
    /// connection and no RST (the packet was dropped, not refused).
    pub fn tcp_dropped(&self, dst: IpAddr, port: u16) -> Result<()> {
        match tcp_request(&self.topo.ext(), dst, port) {
            Ok(got) => bail!("TCP {dst}:{port} should be dropped, got {got:?}"),
            Err(e) => {
                let msg = e.to_string();
                ensure!(
                    !msg.contains("refused"),
                    "TCP {dst}:{port} was refused (RST), not dropped: {msg}"
                );
                Ok(())
            }
        }
    }

    pub fn udp_dropped(&self, dst: IpAddr, port: u16) -> Result<()> {
        if let Ok(got) = udp_request(&self.topo.ext(), dst, port) {
            bail!("UDP {dst}:{port} should be dropped, got {got:?}");
        }
        Ok(())
    }

    /// An ext server sees pod `i`'s TCP and UDP flows coming from `src`,
    /// and the exchanges complete.
    pub fn egress_seen_as(&self, i: usize, src: IpAddr) -> Result<()> {
        let ext = self.topo.ext();
        let _tcp = Server::tcp(&ext, self.fam(), 7000, "ext")?;
        let _udp = Server::udp(&ext, self.fam(), 7001, "ext")?;
        let want = answer("ext", src);
        let got = eventually(SETTLE, || tcp_request(&self.pod_ns(i), self.net.ext, 7000))?;
        ensure!(
            got == want,
            "pod{i} TCP egress: server answered {got:?}, expected {want:?}"
        );
        let got = eventually(SETTLE, || udp_request(&self.pod_ns(i), self.net.ext, 7001))?;
        ensure!(
            got == want,
            "pod{i} UDP egress: server answered {got:?}, expected {want:?}"
        );
        Ok(())
    }

    /// ping from ext to `dst` is answered, by `dst`.
    pub fn ping_answered(&self, dst: IpAddr) -> Result<()> {
        let from = eventually(SETTLE, || ping(&self.topo.ext(), dst))?;
        ensure!(from == dst, "ping {dst}: reply came from {from}");
        Ok(())
    }

    pub fn ping_unanswered(&self, dst: IpAddr) -> Result<()> {
        if let Ok(from) = ping(&self.topo.ext(), dst) {
            bail!("ping {dst} should get no answer, got one from {from}");
        }
        Ok(())
    }

    /// A second managed Service ("other": lb 2 -> pod3, passthrough) with a
    /// TCP server, to show a change or a bad input leaves it alone.
    pub fn other_service(&self) -> Result<Server> {
        self.put_service(&Svc::new("other", self.lb(2)), &[self.pod_ip(3)])?;
        self.serve_tcp(3, WEB)
    }

    pub fn other_still_works(&self) -> Result<()> {
        self.tcp_reaches(self.lb(2), WEB, 3)
    }

    /// HTTP GET on the controller's metrics port ([`Controller::http`]).
    pub fn controller_http(&self, path: &str) -> Result<(u16, String)> {
        self.ctl.http(path)
    }
}

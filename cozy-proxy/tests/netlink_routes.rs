//! Host routes sent many per request, only the last message of each
//! request acknowledged (`Acked::Last`): a route the kernel refuses is
//! still reported, whichever message it is (in the middle of a request,
//! the acknowledged last of one, the very last), and every other route of
//! the batch is applied. Routes changed on another thread (a fresh
//! install's steps) report their failure when settled, or at the next
//! change. In a network namespace of its own, against the real kernel.
//! Needs root.
use anyhow::{bail, ensure, Context, Result};
use cozy_proxy::datapath::{Change, NextHop, Routes};
use cozy_proxy::netlink::{
    addr::{addresses_in, IfAddr, StrictSocket},
    route::{delete_host_routes, host_routes, links, set_host_routes, Via},
    NetlinkError, NlSocket,
};
use cozy_proxy::steer::Steering;
// Commands run in the calling thread's network namespace.
use cozy_proxy_testkit::sh::ok;
use std::{collections::BTreeSet, net::IpAddr};

const PROTO: u8 = 249;
/// Another agent's routes (RTPROT_STATIC).
const OTHER_PROTO: u8 = 4;
/// Three requests of 1 000 (the chunk size) and one of 500.
const ROUTES: usize = 3_500;
/// Refused: in the middle of the first request, the last (acknowledged)
/// message of the second, and the very last message.
const REFUSED: [usize; 3] = [500, 1_999, ROUTES - 1];

fn dst(i: usize) -> Result<IpAddr> {
    Ok(format!("2001:db8:100::{i:x}").parse()?)
}

fn in_own_namespace(test: impl FnOnce() -> Result<()> + Send + 'static) -> Result<()> {
    std::thread::spawn(move || -> Result<()> {
        // SAFETY: unshare on this thread only; the commands it spawns
        // inherit the namespace.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            bail!("unshare: {}", std::io::Error::last_os_error());
        }
        test()
    })
    .join()
    .map_err(|_| anyhow::anyhow!("test thread panicked"))?
}

/// The index of the route a refusal names, from its description.
fn refused_route(e: &NetlinkError) -> Result<IpAddr> {
    match e {
        NetlinkError::Refused { what, .. } => what
            .split_whitespace()
            .find_map(|w| w.parse().ok())
            .with_context(|| format!("no address in {what:?}")),
        other => bail!("expected a refusal, got {other}"),
    }
}

/// A veth pair up, `r0` on 2001:db8::/64: its index.
fn link_up(sock: &NlSocket) -> Result<u32> {
    ok(&[
        "ip", "link", "add", "r0", "type", "veth", "peer", "name", "r1",
    ])?;
    for l in ["r0", "r1", "lo"] {
        ok(&["ip", "link", "set", l, "up"])?;
    }
    ok(&[
        "ip",
        "-6",
        "addr",
        "add",
        "2001:db8::1/64",
        "dev",
        "r0",
        "nodad",
    ])?;
    Ok(links(sock)?
        .into_iter()
        .find(|l| l.name == "r0")
        .context("r0")?
        .index)
}

#[test]
fn a_refused_route_is_reported_and_the_rest_of_the_batch_applied() -> Result<()> {
    in_own_namespace(|| {
        let sock = NlSocket::open(libc::NETLINK_ROUTE)?;
        let oif = link_up(&sock)?;
        let good = Via {
            gateway: Some("2001:db8::2".parse()?),
            oif,
            onlink: false,
            unreachable: false,
            src: None,
        };
        // Not on the link, without onlink: the kernel refuses it.
        let bad = Via {
            gateway: Some("2001:db8:ffff::9".parse()?),
            ..good
        };
        let routes: Vec<(IpAddr, Via)> = (0..ROUTES)
            .map(|i| Ok((dst(i)?, if REFUSED.contains(&i) { bad } else { good })))
            .collect::<Result<_>>()?;
        let err = match set_host_routes(&sock, PROTO, &routes, |r| *r, |_| false) {
            Ok(_) => bail!("the refused routes went unreported"),
            Err(e) => e,
        };
        // The first refusal is the one reported.
        ensure!(refused_route(&err)? == dst(REFUSED[0])?, "{err}");
        let held: BTreeSet<IpAddr> = host_routes(&sock, PROTO)?.into_keys().collect();
        let want: BTreeSet<IpAddr> = (0..ROUTES)
            .filter(|i| !REFUSED.contains(i))
            .map(dst)
            .collect::<Result<_>>()?;
        ensure!(
            held == want,
            "the kernel holds {} routes, {} wanted",
            held.len(),
            want.len()
        );
        // All applied: nothing to report.
        let applied: Vec<(IpAddr, Via)> = routes.iter().map(|(d, _)| (*d, good)).collect();
        set_host_routes(&sock, PROTO, &applied, |r| *r, |_| true)?;
        ensure!(host_routes(&sock, PROTO)?.len() == ROUTES);
        // Another agent's route (another protocol, same destination and
        // metric) is kept, and named; ours beside it goes in.
        let (theirs, free) = (dst(ROUTES + 1)?, dst(ROUTES + 2)?);
        set_host_routes(&sock, OTHER_PROTO, &[(theirs, good)], |r| *r, |_| false)?;
        let kept = set_host_routes(
            &sock,
            PROTO,
            &[(theirs, good), (free, good)],
            |r| *r,
            |_| false,
        )?;
        ensure!(kept == [theirs], "kept: {kept:?}");
        ensure!(host_routes(&sock, OTHER_PROTO)?.contains_key(&theirs));
        ensure!(!host_routes(&sock, PROTO)?.contains_key(&theirs));
        ensure!(host_routes(&sock, PROTO)?.contains_key(&free));
        delete_host_routes(&sock, PROTO, &[free])?;
        // Deleting routes of which some are gone: the first missing one is
        // reported, every other is deleted.
        let gone: Vec<IpAddr> = REFUSED.iter().map(|i| dst(*i)).collect::<Result<_>>()?;
        delete_host_routes(&sock, PROTO, &gone)?;
        let all: Vec<IpAddr> = (0..ROUTES).map(dst).collect::<Result<_>>()?;
        let err = match delete_host_routes(&sock, PROTO, &all) {
            Ok(()) => bail!("deleting missing routes went unreported"),
            Err(e) => e,
        };
        ensure!(refused_route(&err)? == dst(REFUSED[0])?, "{err}");
        let left = host_routes(&sock, PROTO)?;
        ensure!(left.is_empty(), "{} routes left", left.len());
        Ok(())
    })
}

#[test]
fn routes_changed_on_another_thread_report_their_failure() -> Result<()> {
    in_own_namespace(|| {
        let sock = NlSocket::open(libc::NETLINK_ROUTE)?;
        let oif = link_up(&sock)?;
        let mut steering = Steering::open()?;
        let good = NextHop {
            gateway: Some("2001:db8::2".parse()?),
            oif,
            onlink: false,
            src: None,
        };
        let bad = NextHop {
            gateway: Some("2001:db8:ffff::9".parse()?),
            ..good
        };
        let adding = |from: usize, to: usize, refused: Option<usize>| -> Result<_> {
            let add = (from..to)
                .map(|i| Ok((dst(i)?, if Some(i) == refused { bad } else { good })))
                .collect::<Result<_>>()?;
            Ok(Change {
                remove: Vec::new(),
                add,
            })
        };
        // Refused in flight: told when settled, the rest applied.
        steering.apply(&adding(0, 1_500, Some(700))?, Routes::Overlapped)?;
        let err = match steering.settle() {
            Ok(()) => bail!("the refused route went unreported"),
            Err(e) => e,
        };
        ensure!(refused_route(&err)? == dst(700)?, "{err}");
        ensure!(host_routes(&sock, PROTO)?.len() == 1_499);
        // Refused in flight and not settled: the next change tells it and
        // is not made.
        steering.apply(&adding(2_000, 2_100, Some(2_050))?, Routes::Overlapped)?;
        let err = match steering.apply(&adding(3_000, 3_100, None)?, Routes::Overlapped) {
            Ok(()) => bail!("a change went ahead of an earlier failure"),
            Err(e) => e,
        };
        ensure!(refused_route(&err)? == dst(2_050)?, "{err}");
        steering.settle()?;
        let held = host_routes(&sock, PROTO)?;
        ensure!(held.len() == 1_499 + 99, "{} routes", held.len());
        ensure!(!held.contains_key(&dst(3_000)?));
        // Applied in flight: settled without a word, all there.
        steering.apply(&adding(3_000, 3_100, None)?, Routes::Overlapped)?;
        steering.settle()?;
        ensure!(host_routes(&sock, PROTO)?.len() == 1_499 + 99 + 100);
        Ok(())
    })
}

/// A pod's own addresses, read through the node's id of its namespace:
/// the veth's peer is found (namespace id and index), and the address
/// dump of that namespace names the address on that very interface.
#[test]
fn a_veths_peer_namespace_lists_the_pods_own_addresses() -> Result<()> {
    in_own_namespace(|| {
        let pod = format!("addr-pod-{}", std::process::id());
        ok(&["ip", "netns", "add", &pod])?;
        let checked = (|| -> Result<()> {
            ok(&[
                "ip", "link", "add", "hostside", "type", "veth", "peer", "name", "eth0", "netns",
                &pod,
            ])?;
            ok(&[
                "ip",
                "-n",
                &pod,
                "addr",
                "add",
                "192.0.2.11/24",
                "dev",
                "eth0",
            ])?;
            ok(&[
                "ip",
                "-n",
                &pod,
                "addr",
                "add",
                "2001:db8:2::11/64",
                "dev",
                "eth0",
                "nodad",
            ])?;
            ok(&["ip", "-n", &pod, "link", "set", "eth0", "up"])?;
            let sock = NlSocket::open(libc::NETLINK_ROUTE)?;
            let host = links(&sock)?
                .into_iter()
                .find(|l| l.name == "hostside")
                .context("the veth")?;
            let (netnsid, peer) = host.peer_ns.context("the peer's namespace")?;
            let found = addresses_in(&StrictSocket::open()?, netnsid)?;
            for ip in ["192.0.2.11", "2001:db8:2::11"] {
                let ip: IpAddr = ip.parse()?;
                ensure!(
                    found.contains(&IfAddr { ifindex: peer, ip }),
                    "{ip} on {peer} not in {found:?}"
                );
            }
            // Only the pod's: its one interface up (its loopback is down).
            ensure!(found.iter().all(|a| a.ifindex == peer), "{found:?}");
            Ok(())
        })();
        ok(&["ip", "netns", "del", &pod])?;
        checked
    })
}

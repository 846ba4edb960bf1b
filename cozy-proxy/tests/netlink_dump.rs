//! A dump the kernel marks interrupted (NLM_F_DUMP_INTR: the table changed
//! between two parts of it) is made again, and what is read is whole. The
//! link dump (the eBPF backend follows the node's interfaces with it) on a
//! node with hundreds of interfaces, while pods come and go: another agent
//! adds and deletes a link every few milliseconds (bridges: this kernel
//! has no dummy driver). Needs root.
//!
//! (nf_tables does not mark its set element dumps; the nft backend's read
//! relies on reading each set twice instead, see nft/read.rs.)
use anyhow::{bail, ensure, Context, Result};
use cozy_proxy::netlink::{route::links, socket::interrupted_dumps, NlSocket};
// Commands run in the calling thread's network namespace.
use cozy_proxy_testkit::sh::ok;
use std::{
    collections::BTreeSet,
    os::fd::AsRawFd,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

/// Links that stay: the dump of them takes many parts (100: 5 dumps
/// interrupted within 117-232 reads here; 400 made the namespace's teardown
/// hold the kernel's network lock for seconds, slowing the tests after it).
const LINKS: usize = 100;

#[test]
fn interrupted_dumps_are_made_again_and_read_whole() -> Result<()> {
    std::thread::spawn(|| -> Result<()> {
        // SAFETY: unshare on this thread only; the commands it spawns
        // inherit the namespace.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            bail!("unshare: {}", std::io::Error::last_os_error());
        }
        let names: BTreeSet<String> = (0..LINKS).map(|i| format!("stay{i}")).collect();
        let batch = std::env::temp_dir().join(format!("netlink-dump-{}.ip", std::process::id()));
        std::fs::write(
            &batch,
            names
                .iter()
                .map(|n| format!("link add {n} type bridge\n"))
                .collect::<String>(),
        )?;
        let added = ok(&["ip", "-batch", &batch.display().to_string()]);
        let _ = std::fs::remove_file(&batch);
        added?;
        let stop = Arc::new(AtomicBool::new(false));
        let churn = {
            let stop = stop.clone();
            let ns = std::fs::File::open(format!(
                "/proc/self/task/{}/ns/net",
                // SAFETY: gettid has no preconditions.
                unsafe { libc::gettid() }
            ))?;
            std::thread::spawn(move || -> Result<u32> {
                // SAFETY: setns on this thread, into the namespace opened
                // above.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    bail!("setns: {}", std::io::Error::last_os_error());
                }
                let mut changes = 0;
                while !stop.load(Ordering::Relaxed) {
                    ok(&["ip", "link", "add", "churn", "type", "bridge"])?;
                    ok(&["ip", "link", "del", "churn"])?;
                    changes += 2;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(changes)
            })
        };

        let sock = NlSocket::open(libc::NETLINK_ROUTE)?;
        let before = interrupted_dumps();
        let mut reads = 0;
        let mut result = Ok(());
        while reads < 2000 && interrupted_dumps() < before + 5 {
            match links(&sock) {
                Ok(found) => {
                    let found: BTreeSet<String> = found.into_iter().map(|l| l.name).collect();
                    let missing = names.difference(&found).count();
                    if missing > 0 {
                        result = Err(anyhow::anyhow!(
                            "read {reads}: {missing} of {LINKS} links missing"
                        ));
                        break;
                    }
                }
                // Every attempt interrupted: possible under this churn,
                // and an error the caller retries; not a partial read.
                Err(e) if e.to_string().contains("interrupted") => {}
                Err(e) => {
                    result = Err(anyhow::anyhow!("read {reads}: {e}"));
                    break;
                }
            }
            reads += 1;
        }
        stop.store(true, Ordering::Relaxed);
        let changes = churn
            .join()
            .map_err(|_| anyhow::anyhow!("churn thread panicked"))??;
        result?;
        let interrupted = interrupted_dumps() - before;
        eprintln!(
            "{reads} link dumps, {changes} link changes meanwhile, {interrupted} dumps interrupted and made again"
        );
        // The test must have provoked what it is about.
        ensure!(
            interrupted >= 5,
            "only {interrupted} interrupted dumps in {reads} reads ({changes} changes)"
        );
        // And the operator sees it.
        let metrics = cozy_proxy::telemetry::Metrics::new().render();
        let shown: u64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix("cozy_proxy_netlink_dumps_interrupted_total "))
            .context("the metric is not exported")?
            .trim()
            .parse()?;
        ensure!(shown >= interrupted, "the metric shows {shown}, {interrupted} counted");
        Ok(())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("test thread panicked"))?
}

//! Scenarios 12-16: changes to live Services and restarts.
use anyhow::{ensure, Context, Result};
use cozy_proxy_testkit::scenario::WEB;
use cozy_proxy_testkit::{
    controller::manifests::Svc,
    sh::Proc,
    traffic::{eventually, Capture, SETTLE},
    Env,
};
use std::{fs, process::Stdio, time::Duration};

/// Scenario 12: true -> false -> true takes effect without touching other Services.
pub fn s12_mode_change(env: &mut Env) -> Result<()> {
    let _other = env.other_service()?;
    let _ssh = env.serve_tcp(1, 22)?;
    let _web = env.serve_tcp(1, WEB)?;
    let whole = Svc::new("vm1", env.lb(0));
    env.put_service(&whole, &[env.pod_ip(1)])?;
    env.settle()?;
    env.tcp_reaches(env.lb(0), WEB, 1)?;
    env.other_still_works()?;
    // After traffic: on a bridge the node has learned the pods' ports,
    // which their guards follow.
    let before = env.settle()?;

    env.put_service(&whole.clone().filter(&[("TCP", 22)]), &[env.pod_ip(1)])?;
    let during = env.settle()?;
    env.tcp_reaches(env.lb(0), 22, 1)?;
    env.tcp_dropped(env.lb(0), WEB)?;
    env.other_still_works()?;
    ensure!(
        during.svc_pod.get(&env.lb(2)) == before.svc_pod.get(&env.lb(2)),
        "the other Service's mapping changed"
    );

    let mut back = whole.clone();
    back.whole_ip = Some("true".into());
    env.put_service(&back, &[env.pod_ip(1)])?;
    let after = env.settle()?;
    ensure!(
        after == before,
        "true -> false -> true did not restore the datapath"
    );
    env.tcp_reaches(env.lb(0), WEB, 1)?;
    env.other_still_works()
}

/// Scenario 13: Moving the Service to another pod moves both directions.
pub fn s13_endpoint_moves(env: &mut Env) -> Result<()> {
    let svc = Svc::new("vm1", env.lb(0));
    env.put_service(&svc, &[env.pod_ip(1)])?;
    env.settle()?;
    let _a = env.serve_tcp(1, WEB)?;
    let _b = env.serve_tcp(2, WEB)?;
    env.tcp_reaches(env.lb(0), WEB, 1)?;
    env.put_service(&svc, &[env.pod_ip(2)])?;
    let state = env.settle()?;
    ensure!(
        !state.pod_svc.contains_key(&env.pod_ip(1)),
        "pod1 still mapped"
    );
    env.tcp_reaches(env.lb(0), WEB, 2)?;
    env.egress_seen_as(2, env.lb(0))?;
    env.egress_seen_as(1, env.net.node)
}

/// Plain behaviour for vm1 (lb 0 / pod1): nothing of ours left for it,
/// LB_IP does not reach pod1, pod1's egress is masqueraded.
fn plain_again(env: &mut Env) -> Result<()> {
    let state = env.settle()?;
    let (lb, pod) = (env.lb(0), env.pod_ip(1));
    let json = serde_json::to_string(&state)?;
    ensure!(
        !json.contains(&format!("\"{lb}\"")) && !json.contains(&format!("\"{pod}\"")),
        "datapath still holds {lb} or {pod}: {json}"
    );
    env.ping_unanswered(lb)?;
    env.tcp_dropped(lb, WEB).or_else(|_| {
        // Without our drop, the node routes the LB IP back out: a refusal
        // or an ICMP error are both "not reaching pod1".
        Ok::<(), anyhow::Error>(())
    })?;
    env.egress_seen_as(1, env.net.node)
}

/// Scenario 14: Removing the label, or the Service, restores plain behaviour.
pub fn s14_removal_restores_plain(env: &mut Env) -> Result<()> {
    let svc = Svc::new("vm1", env.lb(0));
    let _web = env.serve_tcp(1, WEB)?;
    env.put_service(&svc, &[env.pod_ip(1)])?;
    env.settle()?;
    env.tcp_reaches(env.lb(0), WEB, 1)?;
    // The label goes (and there is no wholeIP annotation): not ours.
    let mut unlabelled = svc.clone();
    unlabelled.label = false;
    env.put_service(&unlabelled, &[env.pod_ip(1)])?;
    plain_again(env)?;
    // Back, then the Service is deleted.
    env.put_service(&svc, &[env.pod_ip(1)])?;
    env.settle()?;
    env.tcp_reaches(env.lb(0), WEB, 1)?;
    env.delete_service("vm1")?;
    plain_again(env)
}

/// Scenario 15: No ready endpoint: LB_IP is not routed anywhere (no loop) and the
/// condition is reported.
pub fn s15_no_ready_endpoint(env: &mut Env) -> Result<()> {
    let _other = env.other_service()?;
    env.put_service_with(
        &Svc::new("vm1", env.lb(0)),
        &[(env.pod_ip(1).to_string(), Some(false))],
    )?;
    let state = env.settle()?;
    ensure!(
        state.unmapped_lbs.contains(&env.lb(0)),
        "LB IP not marked unmapped: {state:?}"
    );
    env.wait_log("NoReadyEndpoint")?;
    // Had the node routed the packet on, it would come back to ext.
    let cap = Capture::start(
        &env.topo.ext(),
        "uplink",
        &format!("dst host {}", env.lb(0)),
        env.scratch("cap"),
    )?;
    env.ping_unanswered(env.lb(0))?;
    let back = cap.stop();
    ensure!(
        back.is_empty(),
        "traffic to the unmapped LB IP came back to ext: {back:#?}"
    );
    env.other_still_works()
}

/// Scenario 16: Restarting the controller loses no packet of a running stream.
pub fn s16_restart_loses_nothing(env: &mut Env) -> Result<()> {
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    env.settle()?;
    env.ping_answered(env.lb(0))?;
    let out = env.scratch("flood");
    let mut flood = Proc::spawn_in(
        &env.topo.ext(),
        &[
            "ping",
            "-n",
            "-q",
            "-i",
            "0.01",
            "-c",
            "400",
            "-W",
            "1",
            &env.lb(0).to_string(),
        ],
        Stdio::from(fs::File::create(&out)?),
        Stdio::null(),
    )?;
    std::thread::sleep(Duration::from_secs(1));
    env.ctl.restart()?;
    env.wait_log("adopting")?;
    let status = flood.child.wait()?;
    let summary = fs::read_to_string(&out)?;
    ensure!(status.success(), "ping flood failed: {summary}");
    let line = summary
        .lines()
        .find(|l| l.contains("packets transmitted"))
        .context("no ping summary")?;
    ensure!(
        line.starts_with("400 packets transmitted, 400 received"),
        "packets lost across the restart: {line}"
    );
    eventually(SETTLE, || env.settle().map(|_| ()))
}

/// Scenario 40: the mapped pod's interface deleted and created again on
/// another port, with its addresses (a pod recreated on the node, a VM's
/// new launcher pod): both directions follow the new port, whatever the
/// node's shape, and the port filter still holds.
pub fn s40_pod_recreated_on_another_port(env: &mut Env) -> Result<()> {
    let svc = Svc::new("vm1", env.lb(0)).filter(&[("TCP", 22)]);
    env.put_service(&svc, &[env.pod_ip(1)])?;
    env.settle()?;
    {
        let _ssh = env.serve_tcp(1, 22)?;
        env.tcp_reaches(env.lb(0), 22, 1)?;
    }
    env.topo.move_pod(1)?;
    let _ssh = env.serve_tcp(1, 22)?;
    let _web = env.serve_tcp(1, WEB)?;
    env.tcp_reaches(env.lb(0), 22, 1)
        .context("ext -> LB IP after the pod's port changed")?;
    env.egress_seen_as(1, env.lb(0))
        .context("the pod's egress after its port changed")?;
    env.settle()?;
    env.tcp_dropped(env.lb(0), WEB)
}

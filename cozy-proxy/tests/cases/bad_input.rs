//! Scenarios 17-20: bad input. The controller keeps running, every other
//! Service keeps working, and the problem is reported.
use anyhow::{ensure, Result};
use cozy_proxy_testkit::scenario::WEB;
use cozy_proxy_testkit::{controller::manifests::Svc, Env};

/// Scenario 17: wholeIP / allowICMP neither "true" nor "false": warning, fail closed.
pub fn s17_invalid_annotation(env: &mut Env) -> Result<()> {
    let _other = env.other_service()?;
    let _ssh = env.serve_tcp(1, 22)?;
    let _web = env.serve_tcp(1, WEB)?;
    let mut svc = Svc::new("vm1", env.lb(0));
    svc.whole_ip = Some("yes".into());
    svc.allow_icmp = Some("maybe".into());
    svc.ports = vec![("TCP".into(), 22)];
    env.put_service(&svc, &[env.pod_ip(1)])?;
    env.settle()?;
    env.wait_log("InvalidAnnotation")?;
    env.wait_log("networking.cozystack.io/wholeIP=\"yes\"")?;
    env.wait_log("networking.cozystack.io/allowICMP=\"maybe\"")?;
    env.tcp_reaches(env.lb(0), 22, 1)?;
    env.tcp_dropped(env.lb(0), WEB)?;
    env.ping_unanswered(env.lb(0))?;
    env.other_still_works()
}

/// Scenario 18: Several ready endpoint addresses: not programmed, warning names them.
pub fn s18_several_endpoints(env: &mut Env) -> Result<()> {
    let _other = env.other_service()?;
    let _a = env.serve_tcp(1, WEB)?;
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1), env.pod_ip(2)])?;
    let state = env.settle()?;
    ensure!(
        !state.svc_pod.contains_key(&env.lb(0)),
        "vm1 was programmed: {state:?}"
    );
    env.wait_log("MultipleEndpoints")?;
    env.wait_log(&format!("{}, {}", env.pod_ip(1), env.pod_ip(2)))?;
    env.ping_unanswered(env.lb(0))?;
    env.other_still_works()
}

/// Scenario 19: Two Services claim one LB IP, or one pod: the older keeps it, the
/// other is warned; deleting the older hands it over.
pub fn s19_conflicts(env: &mut Env) -> Result<()> {
    let _p1 = env.serve_tcp(1, WEB)?;
    let _p2 = env.serve_tcp(2, WEB)?;
    let _p3 = env.serve_tcp(3, WEB)?;
    // Same LB IP: older "a" (pod1) against newer "b" (pod3).
    env.put_service(
        &Svc::new("b", env.lb(0)).created("2021-01-01T00:00:00Z"),
        &[env.pod_ip(3)],
    )?;
    env.put_service(
        &Svc::new("a", env.lb(0)).created("2020-01-01T00:00:00Z"),
        &[env.pod_ip(1)],
    )?;
    // Same pod: older "c" (lb 1) against newer "d" (lb 3), both pod2.
    env.put_service(
        &Svc::new("d", env.lb(3)).created("2021-01-01T00:00:00Z"),
        &[env.pod_ip(2)],
    )?;
    env.put_service(
        &Svc::new("c", env.lb(1)).created("2020-01-01T00:00:00Z"),
        &[env.pod_ip(2)],
    )?;
    env.settle()?;
    env.wait_log("LoadBalancerIPConflict")?;
    env.wait_log("PodIPConflict")?;
    env.tcp_reaches(env.lb(0), WEB, 1)?;
    env.tcp_reaches(env.lb(1), WEB, 2)?;
    env.ping_unanswered(env.lb(3))?;
    env.delete_service("a")?;
    env.delete_service("c")?;
    env.settle()?;
    env.tcp_reaches(env.lb(0), WEB, 3)?;
    env.tcp_reaches(env.lb(3), WEB, 2)
}

/// Scenario 20: Only a hostname in the LB status, or an invalid IP string: skipped
/// with a warning.
pub fn s20_hostname_and_invalid_ip(env: &mut Env) -> Result<()> {
    let _other = env.other_service()?;
    let mut named = Svc::new("named", env.lb(0));
    named.lb_ips = vec![];
    named.hostname = Some("lb.example.com".into());
    env.put_service(&named, &[env.pod_ip(1)])?;
    let mut bad_ip = Svc::new("badip", env.lb(1));
    bad_ip.lb_ips = vec!["203.0.113.300".into(), "2001:db8:203::zz".into()];
    env.put_service(&bad_ip, &[env.pod_ip(2)])?;
    let bad_ep = Svc::new("badep", env.lb(3));
    env.put_service_with(&bad_ep, &[("not-an-ip".into(), None)])?;
    env.settle()?;
    env.wait_log("HostnameOnly")?;
    env.wait_log("\"203.0.113.300\" is not an IP address")?;
    env.wait_log("\"not-an-ip\" in EndpointSlice")?;
    env.other_still_works()
}

/// Scenario 44: Endpoints no pod can hold: another Service's LB IP, the
/// Service's own LB IP. Neither is mapped (a ForbiddenAddress warning
/// each); the Service whose LB IP was named, and another, keep working,
/// and every sync succeeds.
pub fn s44_endpoints_on_lb_ips(env: &mut Env) -> Result<()> {
    let _other = env.other_service()?;
    let _p1 = env.serve_tcp(1, WEB)?;
    env.put_service(&Svc::new("vm1", env.lb(0)), &[env.pod_ip(1)])?;
    env.put_service(&Svc::new("onto-vm1", env.lb(1)), &[env.lb(0)])?;
    env.put_service(&Svc::new("onto-itself", env.lb(3)), &[env.lb(3)])?;
    let state = env.settle()?;
    for lb in [env.lb(1), env.lb(3)] {
        ensure!(
            !state.svc_pod.contains_key(&lb),
            "{lb} was mapped: {state:?}"
        );
        env.ping_unanswered(lb)?;
    }
    env.wait_log("ForbiddenAddress")?;
    env.tcp_reaches(env.lb(0), WEB, 1)?;
    env.egress_seen_as(1, env.lb(0))?;
    ensure!(
        !env.ctl.log_text().contains("sync failed"),
        "a sync failed:\n{}",
        env.ctl.log_text()
    );
    env.other_still_works()
}

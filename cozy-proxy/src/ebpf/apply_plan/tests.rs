//! The order of an apply, without the kernel: golden plans of a filtered,
//! ranged mapping coming and going, and the rule that traffic never passes
//! unfiltered checked on the plans of each kind of change.
use super::*;
use crate::datapath::NextHop;
use crate::model::IpRange;

const LB: &str = "203.0.113.10";
const POD: &str = "192.0.2.11";
const OTHER_POD: &str = "192.0.2.12";

fn a(s: &str) -> IpAddr {
    s.parse().expect("address")
}

fn cidr(s: &str) -> Cidr {
    s.parse().expect("prefix")
}

/// `lb` translated here to `pod` (on interface 7), in port-filter mode
/// (tcp/80, ICMP) when `filtered`, reachable from 198.51.100.0/24 only
/// when `ranged`.
fn mapping(lb: &str, pod: &str, filtered: bool, ranged: bool) -> DatapathState {
    let (lb, pod) = (a(lb), a(pod));
    let mut s = DatapathState::default();
    s.svc_pod.insert(lb, pod);
    s.pod_svc.insert(pod, lb);
    s.guard.insert(lb, 7);
    s.guard.insert(pod, 7);
    s.routes.insert(
        lb,
        NextHop {
            gateway: Some(pod),
            oif: 7,
            onlink: false,
            src: None,
        },
    );
    s.cluster.insert(IpRange::of(&cidr("192.0.2.0/24")));
    if filtered {
        s.filtered_pods.insert(pod);
        s.icmp_allowed_pods.insert(pod);
        s.allowed_ports.insert(AllowedPort {
            pod,
            proto: 6,
            port: 80,
        });
    }
    if ranged {
        s.ranged_lbs.insert(lb);
        s.source_ranges
            .insert((lb, IpRange::of(&cidr("198.51.100.0/24"))));
    }
    s
}

/// The steps of going from `from` to `to`, as printed, with the belief and
/// sweep state a run from `from` leaves.
fn steps(
    from: &DatapathState,
    to: &DatapathState,
    belief: &mut Belief,
    sweep: &mut FlowSweep,
) -> Vec<String> {
    let plan = plan_from(from, to, belief, sweep);
    plan.steps().iter().map(|s| s.to_string()).collect()
}

/// The plan of going from `from` to `to`.
fn plan_from(
    from: &DatapathState,
    to: &DatapathState,
    belief: &mut Belief,
    sweep: &mut FlowSweep,
) -> ApplyPlan {
    let remote_pods = RemotePods::of(to);
    let desired = Desired {
        state: to,
        remote_pods: &remote_pods,
    };
    plan(&from.diff(to), desired, belief, sweep, &BTreeSet::new()).expect("plan")
}

fn empty_belief() -> Belief {
    Belief::of(BTreeMap::new())
}

#[test]
fn a_filtered_ranged_mapping_comes_policies_first_and_goes_policies_last() {
    let (mut belief, mut sweep) = (empty_belief(), FlowSweep::default());
    let none = DatapathState::default();
    let full = mapping(LB, POD, true, true);
    assert_eq!(
        steps(&none, &full, &mut belief, &mut sweep),
        [
            "prefilter up: 192.0.2.11[all,pods] 203.0.113.10[all] cluster 192.0.2.0/24",
            "ports in: 192.0.2.11/6/80",
            "ranges in: cluster 192.0.2.0/24 203.0.113.10 from 198.51.100.0/24",
            "addrs: del [] zero slots [0] put [\
             192.0.2.11 pod,local,filtered,icmp,ranged peer 203.0.113.10 src 7 path 7 slot 0 \
             203.0.113.10 lb,local,filtered,icmp,ranged peer 192.0.2.11 src 7 path 7 slot 0]",
            "flow counts zeroed: [0]",
            // The first apply after a read writes the prefilter whole.
            "prefilter down: ",
        ]
    );
    assert_eq!(
        steps(&full, &none, &mut belief, &mut sweep),
        [
            "addrs: del [192.0.2.11 203.0.113.10] zero slots [0] put []",
            "ranges out: cluster 192.0.2.0/24 203.0.113.10 from 198.51.100.0/24",
            "ports out: 192.0.2.11/6/80",
            "prefilter down: 192.0.2.11[all,pods] 203.0.113.10[all]",
        ]
    );
    // The pod's flows are left to the sweep: nothing consults them now.
    assert!(sweep.stale_flows.contains(&key(&a(POD))));
    assert!(sweep.stale_rev.contains(&(key(&a(LB)), key(&a(POD)))));
}

#[test]
fn a_pod_mapped_anew_forgets_its_ips_flows_before_its_entry() {
    let (mut belief, mut sweep) = (empty_belief(), FlowSweep::default());
    let first = mapping(LB, POD, true, false);
    steps(&DatapathState::default(), &first, &mut belief, &mut sweep);
    // The pod goes, and another Service's pod takes its IP, filtered.
    let gone = DatapathState::default();
    steps(&first, &gone, &mut belief, &mut sweep);
    let reused = mapping("203.0.113.20", POD, true, false);
    let out = steps(&gone, &reused, &mut belief, &mut sweep);
    let forget = position(&out, "forget flows: 192.0.2.11");
    let addrs = position(&out, "addrs:");
    assert!(forget < addrs, "{out:#?}");
}

fn position(steps: &[String], prefix: &str) -> usize {
    steps
        .iter()
        .position(|s| s.starts_with(prefix))
        .unwrap_or_else(|| panic!("no step {prefix:?} in {steps:#?}"))
}

/// The rule, on one plan: a port or source range an entry needs is in
/// before the entry is written and out only after no entry needs it; an
/// address's prefilter bit is up before its entry and down after.
fn assert_never_unfiltered(plan: &ApplyPlan, to: &DatapathState) {
    let steps = plan.steps();
    let at = |want: fn(&Step) -> bool| steps.iter().position(want);
    let addrs = at(|s| matches!(s, Step::Addrs(_)));
    let before_addrs = |i: Option<usize>| match (i, addrs) {
        (Some(i), Some(w)) => i < w,
        _ => true,
    };
    let after_addrs = |i: Option<usize>| match (i, addrs) {
        (Some(i), Some(w)) => i > w,
        _ => true,
    };
    let names: Vec<String> = steps.iter().map(|s| s.to_string()).collect();
    type Is = fn(&Step) -> bool;
    let before: [(&str, Is); 4] = [
        ("prefilter up", |s| matches!(s, Step::PrefilterUp { .. })),
        ("ports in", |s| matches!(s, Step::PortsIn(_))),
        ("ranges in", |s| matches!(s, Step::RangesIn(_))),
        ("flows forgotten", |s| matches!(s, Step::ForgetFlows(_))),
    ];
    let after: [(&str, Is); 3] = [
        ("ports out", |s| matches!(s, Step::PortsOut(_))),
        ("ranges out", |s| matches!(s, Step::RangesOut(_))),
        ("prefilter down", |s| matches!(s, Step::PrefilterDown(_))),
    ];
    for (what, is) in before {
        assert!(before_addrs(at(is)), "{what} after addrs: {names:#?}");
    }
    for (what, is) in after {
        assert!(after_addrs(at(is)), "{what} before addrs: {names:#?}");
    }
    // Nothing the target needs leaves.
    for k in &plan.ports_out {
        let p = AllowedPort {
            pod: ip(&k.pod),
            proto: k.proto,
            port: k.port,
        };
        assert!(!to.allowed_ports.contains(&p), "{p:?} removed");
    }
    for (lb, c) in &plan.ranges_out.sources {
        let kept = (to.source_ranges.iter()).any(|(l, r)| l == lb && r.cidrs().contains(c));
        assert!(!kept, "{lb} from {c} removed");
    }
}

#[test]
fn every_kind_of_change_keeps_policies_around_the_entries() {
    let states = [
        DatapathState::default(),
        mapping(LB, POD, false, false),
        mapping(LB, POD, true, false),
        mapping(LB, POD, false, true),
        mapping(LB, POD, true, true),
        mapping(LB, OTHER_POD, true, true),
        mapping("203.0.113.20", POD, true, false),
    ];
    // Every pair, each from the belief a run of the first left.
    for from in &states {
        for to in &states {
            let (mut belief, mut sweep) = (empty_belief(), FlowSweep::default());
            let none = DatapathState::default();
            plan_from(&none, from, &mut belief, &mut sweep);
            let p = plan_from(from, to, &mut belief, &mut sweep);
            assert_never_unfiltered(&p, to);
        }
    }
}

#[test]
fn a_moved_mapping_keeps_its_counter_slot_and_a_new_one_starts_at_zero() {
    let (mut belief, mut sweep) = (empty_belief(), FlowSweep::default());
    let none = DatapathState::default();
    let mut two = mapping(LB, POD, false, false);
    let second = mapping("203.0.113.20", OTHER_POD, false, false);
    two.svc_pod.extend(second.svc_pod.clone());
    two.pod_svc.extend(second.pod_svc.clone());
    steps(&none, &two, &mut belief, &mut sweep);
    let slot = |belief: &Belief, s: &str| belief.addrs.get(&a(s)).map(|w| w.slot);
    assert_eq!(
        (slot(&belief, LB), slot(&belief, "203.0.113.20")),
        (Some(0), Some(1))
    );
    // The first goes; a third takes the freed slot, zeroed first.
    let mut next = second.clone();
    let third = mapping("203.0.113.30", "192.0.2.13", false, false);
    next.svc_pod.extend(third.svc_pod.clone());
    next.pod_svc.extend(third.pod_svc.clone());
    let out = steps(&two, &next, &mut belief, &mut sweep);
    assert_eq!(slot(&belief, "203.0.113.20"), Some(1), "kept");
    assert_eq!(slot(&belief, "203.0.113.30"), Some(2), "searched on");
    let addrs = &out[position(&out, "addrs:")];
    assert!(addrs.contains("zero slots [0, 2]"), "{addrs}");
}

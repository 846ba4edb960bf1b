//! Human-readable form of a [`Dump`] for `cozy-proxy dump`.
use super::Dump;
use std::fmt::Write;

pub fn render_text(dump: &Dump) -> String {
    let mut out = String::new();
    let s = &dump.state;
    let _ = writeln!(
        out,
        "backend: {} ({})",
        dump.backend,
        if dump.installed {
            "installed"
        } else {
            "not installed"
        }
    );
    let _ = writeln!(out, "svc_pod (LoadBalancer IP -> pod):");
    for (lb, pod) in &s.svc_pod {
        let _ = writeln!(out, "  {lb} -> {pod}");
    }
    let _ = writeln!(out, "pod_svc (pod -> LoadBalancer IP):");
    for (pod, lb) in &s.pod_svc {
        let _ = writeln!(out, "  {pod} -> {lb}");
    }
    let _ = writeln!(out, "filtered_pods:");
    for pod in &s.filtered_pods {
        let icmp = if s.icmp_allowed_pods.contains(pod) {
            " (ICMP allowed)"
        } else {
            ""
        };
        let ports: Vec<String> = s
            .allowed_ports
            .iter()
            .filter(|p| p.pod == *pod)
            .map(|p| format!("{}/{}", proto_name(p.proto), p.port))
            .collect();
        let _ = writeln!(out, "  {pod}{icmp}: {}", ports.join(" "));
    }
    let _ = writeln!(out, "unmapped_lbs (dropped):");
    for lb in &s.unmapped_lbs {
        let _ = writeln!(out, "  {lb}");
    }
    if !dump.details.is_null() {
        let _ = writeln!(out, "details:");
        let pretty = serde_json::to_string_pretty(&dump.details).unwrap_or_default();
        for line in pretty.lines() {
            let _ = writeln!(out, "  {line}");
        }
    }
    out
}

fn proto_name(p: u8) -> String {
    match crate::model::Protocol::from_number(p) {
        Some(crate::model::Protocol::Tcp) => "tcp".into(),
        Some(crate::model::Protocol::Udp) => "udp".into(),
        Some(crate::model::Protocol::Sctp) => "sctp".into(),
        None => p.to_string(),
    }
}

//! Human-readable form of a [`Dump`] for `cozy-proxy dump`: the tables
//! as lists, and the backend's details as indented text, a list of like
//! records (an nft chain's rules with their counters, the programs on a
//! hook) as a table. `-o json` keeps every field as it is.
use super::Dump;
use serde_json::Value;
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
    if !dump.placement.is_empty() {
        let _ = writeln!(
            out,
            "placement (what this node does with each LB IP, and why):"
        );
        let keys = ["lb_ip", "pod_ip", "here", "nodes", "why"].map(String::from);
        let keys: Vec<&String> = keys.iter().collect();
        let rows: Vec<Value> = (dump.placement.iter())
            .filter_map(|p| serde_json::to_value(p).ok())
            .collect();
        table(&mut out, "  ", &keys, &rows);
    }
    if !dump.details.is_null() {
        let _ = writeln!(out, "details:");
        details(&mut out, 1, &dump.details);
    }
    out
}

/// A scalar as a person reads it (`-` for none).
fn scalar(v: &Value) -> Option<String> {
    match v {
        Value::Null => Some("-".into()),
        Value::String(s) => Some(s.clone()),
        Value::Bool(_) | Value::Number(_) => Some(v.to_string()),
        Value::Array(_) | Value::Object(_) => None,
    }
}

/// The columns of `items` if they are records of scalars with the same
/// keys (a table), else `None`.
fn columns(items: &[Value]) -> Option<Vec<&String>> {
    let first = items.first()?.as_object()?;
    let keys: Vec<&String> = first.keys().collect();
    let alike = items.iter().all(|i| {
        i.as_object().is_some_and(|o| {
            o.len() == keys.len()
                && o.iter()
                    .all(|(k, v)| first.contains_key(k) && scalar(v).is_some())
        })
    });
    // Counts first, text last (a rule's comment, whatever its length).
    let mut keys = alike.then_some(keys)?;
    keys.sort_by_key(|k| !numeric(items, k));
    Some(keys)
}

/// Does column `key` of `items` hold numbers (or nothing)?
fn numeric(items: &[Value], key: &str) -> bool {
    (items.iter()).all(|i| matches!(i[key], Value::Number(_) | Value::Null))
}

/// `items` as a table: a header, then a row each; numbers right-aligned,
/// the last column left as it is (a rule's comment).
fn table(out: &mut String, pad: &str, keys: &[&String], items: &[Value]) {
    let rows: Vec<Vec<String>> = (items.iter())
        .map(|i| {
            keys.iter()
                .map(|k| scalar(&i[k.as_str()]).unwrap_or_default())
                .collect()
        })
        .collect();
    let widths: Vec<usize> = (0..keys.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].len())
                .chain([keys[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<String>, numeric: &dyn Fn(usize) -> bool| -> String {
        let last = cells.len().saturating_sub(1);
        let cells: Vec<String> = (cells.into_iter().enumerate())
            .map(|(c, v)| match (c == last, numeric(c)) {
                (true, _) => v,
                (false, true) => format!("{v:>w$}", w = widths[c]),
                (false, false) => format!("{v:<w$}", w = widths[c]),
            })
            .collect();
        format!("{pad}{}", cells.join("  ").trim_end())
    };
    let numeric = |c: usize| numeric(items, keys[c]);
    let _ = writeln!(
        out,
        "{}",
        line(keys.iter().map(|k| k.to_string()).collect(), &numeric)
    );
    for r in rows {
        let _ = writeln!(out, "{}", line(r, &numeric));
    }
}

/// `v` at depth `depth`: a record's scalars as `key: value`, its lists
/// and records below their key.
fn details(out: &mut String, depth: usize, v: &Value) {
    let pad = "  ".repeat(depth);
    match v {
        Value::Object(o) => {
            // Its scalars first, then what nests.
            for (k, s) in o.iter().filter_map(|(k, v)| Some((k, scalar(v)?))) {
                let _ = writeln!(out, "{pad}{k}: {s}");
            }
            for (k, v) in o.iter().filter(|(_, v)| scalar(v).is_none()) {
                let _ = writeln!(out, "{pad}{k}:");
                details(out, depth + 1, v);
            }
        }
        Value::Array(items) => match columns(items) {
            Some(keys) => table(out, &pad, &keys, items),
            None => {
                for item in items {
                    match scalar(item) {
                        Some(s) => {
                            let _ = writeln!(out, "{pad}- {s}");
                        }
                        None => {
                            let _ = writeln!(out, "{pad}-");
                            details(out, depth + 1, item);
                        }
                    }
                }
            }
        },
        _ => {
            let _ = writeln!(out, "{pad}{}", scalar(v).unwrap_or_default());
        }
    }
}

fn proto_name(p: u8) -> String {
    match crate::model::Protocol::from_number(p) {
        Some(crate::model::Protocol::Tcp) => "tcp".into(),
        Some(crate::model::Protocol::Udp) => "udp".into(),
        Some(crate::model::Protocol::Sctp) => "sctp".into(),
        None => p.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::{BackendKind, Counters, DatapathState};
    use serde_json::json;

    /// nft's details as `dump` reads them: each chain's rules with their
    /// counters read as a table, not as JSON.
    #[test]
    fn details_read_as_text_and_rules_as_a_table() {
        let dump = Dump {
            backend: BackendKind::Nft,
            installed: true,
            state: DatapathState::default(),
            counters: Counters::default(),
            placement: Vec::new(),
            details: json!({ "tables": [{
                "table": "ip cozy_proxy",
                "chains": [{ "name": "egress_snat", "priority": -300, "rules": [
                    { "packets": 12, "bytes": 3456, "comment": "anti-spoofing" },
                    { "packets": null, "bytes": null, "comment": "not a guarded source" },
                ]}],
            }]}),
        };
        let text = render_text(&dump);
        let details = &text[text.find("details:").expect("details")..];
        assert_eq!(
            details,
            "details:
  tables:
    -
      table: ip cozy_proxy
      chains:
        -
          name: egress_snat
          priority: -300
          rules:
            bytes  packets  comment
             3456       12  anti-spoofing
                -        -  not a guarded source
"
        );
        assert!(!text.contains('{'), "{text}");
    }

    /// Each LB IP's placement reads as one row of a table.
    #[test]
    fn placement_reads_as_a_table() {
        let dump = Dump {
            backend: BackendKind::Ebpf,
            installed: true,
            state: DatapathState::default(),
            counters: Counters::default(),
            placement: vec![super::super::Placement {
                lb_ip: "203.0.113.12".parse().expect("address"),
                pod_ip: Some("192.0.2.12".parse().expect("address")),
                here: "steered via 198.51.100.3".into(),
                nodes: Some("node1,node2".into()),
                why: "route via 198.51.100.3 (node2)".into(),
            }],
            details: Value::Null,
        };
        let text = render_text(&dump);
        let table = &text[text.find("placement").expect("placement")..];
        assert_eq!(
            table,
            "placement (what this node does with each LB IP, and why):
  lb_ip         pod_ip      here                      nodes        why
  203.0.113.12  192.0.2.12  steered via 198.51.100.3  node1,node2  route via 198.51.100.3 (node2)
"
        );
    }
}

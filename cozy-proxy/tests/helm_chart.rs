//! The Helm chart through the real `helm` 3 (`cargo xtask setup` installs
//! it): lint, render for each backend, check the rendered objects, and
//! refuse bad values through values.schema.json.
use serde_yaml::Value;
use std::{path::PathBuf, process::Command};

fn chart() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/cozy-proxy")
        .display()
        .to_string()
}

fn helm(args: &[&str]) -> (bool, String, String) {
    let out = Command::new("helm")
        .args(args)
        .output()
        .expect("helm 3 on PATH (cargo xtask setup installs it)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn render(sets: &[&str]) -> Vec<Value> {
    let chart = chart();
    let mut args = vec!["template", "cozy", chart.as_str(), "-n", "kube-system"];
    for s in sets {
        args.extend(["--set", s]);
    }
    let (ok, out, err) = helm(&args);
    assert!(ok, "helm template {sets:?}: {err}");
    serde_yaml::Deserializer::from_str(&out)
        .filter_map(|d| serde::Deserialize::deserialize(d).ok())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(kind))
        .unwrap_or_else(|| panic!("no {kind} rendered"))
}

fn strings(v: &Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| {
            s.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn helm_lint_passes_for_each_backend() {
    for backend in ["auto", "ebpf", "nft"] {
        let set = format!("backend={backend}");
        let (ok, out, err) = helm(&["lint", &chart(), "--set", &set]);
        assert!(ok, "helm lint {backend}: {out}{err}");
    }
}

#[test]
fn the_daemonset_asks_for_what_each_backend_needs_and_no_more() {
    for (backend, caps, seccomp) in [
        ("nft", vec!["NET_ADMIN"], "RuntimeDefault"),
        ("ebpf", vec!["NET_ADMIN", "BPF", "PERFMON"], "Localhost"),
        ("auto", vec!["NET_ADMIN", "BPF", "PERFMON"], "Localhost"),
    ] {
        let docs = render(&[&format!("backend={backend}")]);
        let ds = find(&docs, "DaemonSet");
        let pod = &ds["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        let sc = &c["securityContext"];
        assert_eq!(strings(&sc["capabilities"]["add"]), caps, "{backend}");
        assert_eq!(strings(&sc["capabilities"]["drop"]), vec!["ALL"]);
        assert_eq!(sc["privileged"].as_bool(), Some(false));
        assert_eq!(sc["allowPrivilegeEscalation"].as_bool(), Some(false));
        assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true));
        assert_eq!(sc["seccompProfile"]["type"].as_str(), Some(seccomp));
        // The Localhost profile is installed by an init container with no
        // capability at all, into the kubelet's seccomp directory.
        let init = &pod["initContainers"][0];
        if seccomp == "Localhost" {
            assert_eq!(
                sc["seccompProfile"]["localhostProfile"].as_str(),
                Some("cozy-proxy/cozy-proxy-ebpf.json")
            );
            assert_eq!(init["name"].as_str(), Some("install-seccomp-profile"));
            assert_eq!(
                strings(&init["securityContext"]["capabilities"]["drop"]),
                vec!["ALL"]
            );
            assert!(init["securityContext"]["capabilities"]["add"].is_null());
            let volumes = serde_yaml::to_string(&pod["volumes"]).unwrap_or_default();
            assert!(volumes.contains("/var/lib/kubelet/seccomp"), "{volumes}");
        } else {
            assert!(init.is_null(), "{backend}: init container {init:?}");
        }
        // Every backend mounts the pin directory alone (the nft pod retires
        // an eBPF datapath a switch left), never the host's whole bpffs.
        let mounts = serde_yaml::to_string(&c["volumeMounts"]).unwrap_or_default();
        assert!(
            mounts.contains("mountPath: /bpf-pins"),
            "{backend}: {mounts}"
        );
        let host_paths: Vec<&str> = (pod["volumes"].as_sequence().into_iter().flatten())
            .filter_map(|v| v["hostPath"]["path"].as_str())
            .collect();
        let mut want = vec!["/sys/fs/bpf/cozy-proxy"];
        if seccomp == "Localhost" {
            want.push("/var/lib/kubelet/seccomp");
        }
        assert_eq!(host_paths, want, "{backend}");
        assert!(strings(&c["args"]).contains(&"--bpf-pin-dir=/bpf-pins".to_string()));
        assert!(strings(&c["args"]).contains(&format!("--backend={backend}")));
        assert_eq!(pod["hostNetwork"].as_bool(), Some(true));
        assert_eq!(
            pod["priorityClassName"].as_str(),
            Some("system-node-critical")
        );
        assert_eq!(
            pod["tolerations"][0]["operator"].as_str(),
            Some("Exists"),
            "runs on every node"
        );
        assert_eq!(pod["serviceAccountName"].as_str(), Some("cozy-proxy"));
        let env = serde_yaml::to_string(&c["env"]).unwrap_or_default();
        assert!(
            env.contains("NODE_NAME") && env.contains("spec.nodeName"),
            "{env}"
        );
        assert_eq!(
            c["livenessProbe"]["httpGet"]["path"].as_str(),
            Some("/healthz")
        );
        assert_eq!(
            c["readinessProbe"]["httpGet"]["path"].as_str(),
            Some("/readyz")
        );
        // The probes go to the loopback server, which the network's clients
        // cannot reach.
        let args = serde_yaml::to_string(&c["args"]).unwrap_or_default();
        assert!(args.contains("--health-addr=127.0.0.1:9403"), "{args}");
        for probe in ["livenessProbe", "readinessProbe"] {
            assert_eq!(c[probe]["httpGet"]["host"].as_str(), Some("127.0.0.1"));
            assert_eq!(c[probe]["httpGet"]["port"].as_i64(), Some(9403));
        }
        assert_eq!(
            ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"].as_i64(),
            Some(1)
        );
    }
}

#[test]
fn the_cluster_role_has_exactly_the_controllers_rules() {
    let docs = render(&[]);
    let role = find(&docs, "ClusterRole");
    let out = Command::new(env!("CARGO_BIN_EXE_cozy-proxy"))
        .arg("rbac")
        .output()
        .expect("cozy-proxy rbac");
    let wanted: Value = serde_yaml::from_slice(&out.stdout).expect("rbac YAML");
    assert_eq!(role["rules"], wanted);
    let out = Command::new(env!("CARGO_BIN_EXE_cozy-proxy"))
        .args(["rbac", "--role-for", "cozy-proxy"])
        .output()
        .expect("cozy-proxy rbac --role-for");
    let wanted: Value = serde_yaml::from_slice(&out.stdout).expect("role YAML");
    assert_eq!(find(&docs, "Role")["rules"], wanted);
    let ds = find(&docs, "DaemonSet");
    let env = serde_yaml::to_string(&ds["spec"]["template"]["spec"]["containers"][0]["env"])
        .unwrap_or_default();
    assert!(
        env.contains("kube-system/cozy-proxy"),
        "the controller knows its DaemonSet: {env}"
    );
    let binding = find(&docs, "ClusterRoleBinding");
    assert_eq!(binding["subjects"][0]["name"].as_str(), Some("cozy-proxy"));
    assert_eq!(
        binding["subjects"][0]["namespace"].as_str(),
        Some("kube-system")
    );
}

#[test]
fn values_show_up_where_they_belong() {
    let docs = render(&[
        "interfaces=eth0\\,eth1",
        "metrics.port=9555",
        "image.tag=v9",
        "logLevel=debug",
        "metrics.serviceMonitor.enabled=true",
    ]);
    let c = &find(&docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0];
    let args = strings(&c["args"]);
    assert!(
        args.contains(&"--interfaces=eth0,eth1".to_string()),
        "{args:?}"
    );
    assert!(
        args.contains(&"--metrics-addr=0.0.0.0:9555".to_string()),
        "{args:?}"
    );
    assert!(c["image"].as_str().is_some_and(|i| i.ends_with(":v9")));
    assert_eq!(c["ports"][0]["containerPort"].as_i64(), Some(9555));
    find(&docs, "ServiceMonitor");
    // nft on a node without a bpffs: nothing of the host's bpffs mounted.
    let docs = render(&["backend=nft", "mountBpfPinDir=false"]);
    let pod = &find(&docs, "DaemonSet")["spec"]["template"]["spec"];
    assert!(pod["volumes"].is_null(), "{:?}", pod["volumes"]);
    assert!(pod["containers"][0]["volumeMounts"].is_null());
    assert!(!render(&[])
        .iter()
        .any(|d| d["kind"].as_str() == Some("ServiceMonitor")));
}

#[test]
fn cluster_cidrs_and_fast_path_reach_the_arguments() {
    let docs = render(&[
        "clusterCIDRs={10.244.0.0/16,fd00:10:244::/56}",
        "deriveClusterCIDRs=false",
        "fastPath=true",
        "reservedCIDRs={192.0.2.250/32}",
        "namespaceShare=30",
        "trustUnmanagedSlices={infra,platform}",
    ]);
    let args =
        strings(&find(&docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert!(
        args.contains(&"--cluster-cidrs=10.244.0.0/16,fd00:10:244::/56".to_string()),
        "{args:?}"
    );
    assert!(
        args.contains(&"--derive-cluster-cidrs=false".to_string()),
        "{args:?}"
    );
    assert!(args.contains(&"--fast-path=true".to_string()), "{args:?}");
    assert!(
        args.contains(&"--reserved-cidrs=192.0.2.250/32".to_string()),
        "{args:?}"
    );
    assert!(
        args.contains(&"--namespace-share=30".to_string()),
        "{args:?}"
    );
    assert!(
        args.contains(&"--trust-unmanaged-slices=infra,platform".to_string()),
        "{args:?}"
    );
    let defaults = render(&[]);
    let args =
        strings(&find(&defaults, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert!(
        !args.iter().any(|a| a.starts_with("--cluster-cidrs")
            || a.starts_with("--reserved-cidrs")
            || a.starts_with("--trust-unmanaged-slices")),
        "{args:?}"
    );
    assert!(
        args.contains(&"--derive-cluster-cidrs=true".to_string()),
        "{args:?}"
    );
    assert!(
        args.contains(&"--namespace-share=50".to_string()),
        "{args:?}"
    );
}

#[test]
fn bad_values_are_refused_by_the_schema() {
    let chart = chart();
    for bad in [
        "backend=ebfp",
        "interfaces=eth0;reboot",
        "metrics.port=0",
        "metrics.port=70000",
        "image.pullPolicy=Sometimes",
        "resync=soon",
        "bpfPinDir=/tmp/x",
        "backnd=nft",
        "clusterCIDRs={10.0.0.0/8;reboot}",
        "reservedCIDRs={10.0.0.1;reboot}",
        "trustUnmanagedSlices={ns;reboot}",
        "namespaceShare=0",
        "namespaceShare=101",
        "deriveClusterCIDRs=maybe",
    ] {
        let (ok, _, err) = helm(&["template", "cozy", &chart, "--set", bad]);
        assert!(!ok, "{bad} was accepted");
        assert!(
            err.contains("schema")
                || err.contains("must be")
                || err.contains("Additional property")
                || err.contains("additional properties"),
            "{bad}: {err}"
        );
    }
}

#[test]
fn the_ebpf_seccomp_profile_can_be_chosen() {
    for (choice, init) in [
        ("RuntimeDefault", false),
        ("Unconfined", false),
        ("Localhost", true),
    ] {
        let docs = render(&["backend=ebpf", &format!("seccomp.ebpf={choice}")]);
        let pod = &find(&docs, "DaemonSet")["spec"]["template"]["spec"];
        let sc = &pod["containers"][0]["securityContext"];
        assert_eq!(sc["seccompProfile"]["type"].as_str(), Some(choice));
        assert_eq!(!pod["initContainers"].is_null(), init, "{choice}");
    }
    let (ok, _, err) = helm(&["template", "cozy", &chart(), "--set", "seccomp.ebpf=Off"]);
    assert!(!ok, "an unknown seccomp choice must fail the schema");
    assert!(err.contains("seccomp"), "{err}");
}

#[test]
fn zero_periods_are_refused_by_the_schema() {
    for bad in [
        "resync=0s",
        "resync=0ms",
        "resync=5ms",
        "resync=1h",
        "debounce=-1s",
    ] {
        let (ok, _, err) = helm(&["template", "cozy", &chart(), "--set", bad]);
        assert!(!ok, "{bad} accepted");
        assert!(
            err.contains("pattern") || err.contains("resync") || err.contains("debounce"),
            "{bad}: {err}"
        );
    }
    for good in [
        "resync=10ms",
        "resync=60s",
        "resync=5m",
        "debounce=0ms",
        "debounce=50ms",
    ] {
        let (ok, _, err) = helm(&["template", "cozy", &chart(), "--set", good]);
        assert!(ok, "{good} refused: {err}");
    }
}

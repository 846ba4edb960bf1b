//! Services and EndpointSlices written as YAML files into the directory the
//! controller watches, the way an operator would write them.
use anyhow::{Context, Result};
use std::{
    fs,
    net::IpAddr,
    path::{Path, PathBuf},
};

#[derive(Clone, Debug)]
pub struct Svc {
    pub name: String,
    /// Selected by the service-proxy-name label (else only by annotation).
    pub label: bool,
    pub whole_ip: Option<String>,
    pub allow_icmp: Option<String>,
    /// `(protocol, port)`, e.g. `("TCP", 22)`.
    pub ports: Vec<(String, u16)>,
    /// Raw strings for `status.loadBalancer.ingress[].ip`.
    pub lb_ips: Vec<String>,
    pub hostname: Option<String>,
    pub created: Option<String>,
    /// `spec.loadBalancerSourceRanges`, as written.
    pub source_ranges: Vec<String>,
}

impl Svc {
    /// A labelled passthrough Service with one LoadBalancer IP.
    pub fn new(name: &str, lb: IpAddr) -> Svc {
        Svc {
            name: name.into(),
            label: true,
            whole_ip: None,
            allow_icmp: None,
            ports: vec![],
            lb_ips: vec![lb.to_string()],
            hostname: None,
            created: None,
            source_ranges: vec![],
        }
    }

    pub fn filter(mut self, ports: &[(&str, u16)]) -> Svc {
        self.whole_ip = Some("false".into());
        self.ports = ports.iter().map(|(p, n)| (p.to_string(), *n)).collect();
        self
    }

    pub fn created(mut self, ts: &str) -> Svc {
        self.created = Some(ts.into());
        self
    }

    pub fn yaml(&self) -> String {
        let mut y = format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {}\n  namespace: default\n",
            self.name
        );
        if let Some(c) = &self.created {
            y += &format!("  creationTimestamp: \"{c}\"\n");
        }
        if self.label {
            y += "  labels:\n    service.kubernetes.io/service-proxy-name: cozy-proxy\n";
        }
        let mut ann = Vec::new();
        if let Some(v) = &self.whole_ip {
            ann.push(format!("    networking.cozystack.io/wholeIP: \"{v}\"\n"));
        }
        if let Some(v) = &self.allow_icmp {
            ann.push(format!("    networking.cozystack.io/allowICMP: \"{v}\"\n"));
        }
        if !ann.is_empty() {
            y += "  annotations:\n";
            y += &ann.concat();
        }
        y += "spec:\n  type: LoadBalancer\n";
        if !self.source_ranges.is_empty() {
            y += "  loadBalancerSourceRanges:\n";
            for r in &self.source_ranges {
                y += &format!("  - \"{r}\"\n");
            }
        }
        if !self.ports.is_empty() {
            y += "  ports:\n";
            for (proto, port) in &self.ports {
                y += &format!("  - {{port: {port}, protocol: {proto}}}\n");
            }
        }
        y += "status:\n  loadBalancer:\n    ingress:\n";
        for ip in &self.lb_ips {
            y += &format!("    - ip: \"{ip}\"\n");
        }
        if let Some(h) = &self.hostname {
            y += &format!("    - hostname: \"{h}\"\n");
        }
        y
    }
}

/// An EndpointSlice of `service` with `(address, ready)` endpoints.
pub fn slice(service: &str, address_type: &str, endpoints: &[(String, Option<bool>)]) -> String {
    let mut y = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {service}-{}\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {service}\naddressType: {address_type}\nendpoints:\n",
        address_type.to_lowercase()
    );
    for (addr, ready) in endpoints {
        y += &format!("- addresses: [\"{addr}\"]\n");
        if let Some(r) = ready {
            y += &format!("  conditions: {{ready: {r}}}\n");
        }
    }
    y
}

/// The watched directory, removed when dropped.
pub struct ManifestDir {
    pub path: PathBuf,
}

impl ManifestDir {
    pub fn new(prefix: &str) -> Result<ManifestDir> {
        let path = std::env::temp_dir().join(format!("{prefix}-manifests"));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(ManifestDir { path })
    }

    /// Writes (or replaces, atomically) `name.yaml`.
    pub fn put(&self, name: &str, yaml: &str) -> Result<()> {
        let tmp = self.path.join(format!(".{name}.tmp"));
        fs::write(&tmp, yaml)?;
        fs::rename(&tmp, self.file(name))?;
        Ok(())
    }

    /// Removes `name.yaml`. The last one removed leaves the marker that
    /// says "empty on purpose" (an emptied directory otherwise keeps the
    /// last state: `cozy_proxy::source::EMPTY_MARKER`).
    pub fn remove(&self, name: &str) -> Result<()> {
        fs::remove_file(self.file(name)).with_context(|| format!("removing {name}"))?;
        let left = cozy_proxy::source::manifests::manifest_files(&self.path)?;
        if left.is_empty() {
            fs::write(self.path.join(cozy_proxy::source::EMPTY_MARKER), "")?;
        }
        Ok(())
    }

    fn file(&self, name: &str) -> PathBuf {
        self.path.join(format!("{name}.yaml"))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ManifestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// The `.yaml` files of a directory, sorted.
pub fn files_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    Ok(files)
}

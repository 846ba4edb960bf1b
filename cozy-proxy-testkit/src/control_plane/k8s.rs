//! A real Kubernetes control plane for the tests, in a network namespace
//! (the node's, so that the controller reaches it on loopback): etcd,
//! kube-apiserver (TLS with its own CA, static-token admin, RBAC on,
//! service-account tokens) and kube-controller-manager (its EndpointSlice
//! controller makes the slices cozy-proxy reads). Built from their Go
//! modules by `cargo xtask setup` (xtask/src/k8s.rs); started and stopped
//! here, nothing left behind.
use crate::controller::manifests::Svc;
use crate::sh::{ok, ok_in, Proc};
use crate::traffic::eventually;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{Mutex, PoisonError},
    time::Duration,
};

/// The version `cargo xtask setup` builds (xtask/src/k8s.rs).
pub const KUBERNETES: &str = "v1.34.4";

/// Where the binaries are: `$COZY_PROXY_K8S_BIN`, or setup's cache.
pub fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("COZY_PROXY_K8S_BIN") {
        return PathBuf::from(dir);
    }
    crate::sh::setup_cache("COZY_PROXY_K8S_CACHE", &format!("k8s-{KUBERNETES}")).join("bin")
}

/// Are the binaries there? (`cargo xtask setup` builds them.)
pub fn available() -> bool {
    ["kube-apiserver", "kube-controller-manager", "etcd"]
        .iter()
        .all(|b| bin_dir().join(b).is_file())
}

/// The admin's static token (system:masters).
const ADMIN_TOKEN: &str = "cozy-proxy-tests-admin";
/// Kubelets the static tokens know: `node1` to `nodeN`.
const MAX_KUBELETS: usize = 4;

/// The static token of kubelet `node` (user `system:node:<node>`, group
/// `system:nodes`: what the Node authorizer grants a kubelet).
pub fn node_token(node: &str) -> String {
    format!("cozy-proxy-tests-kubelet-{node}")
}
/// Service CIDRs (dual-stack): inside the tests' documentation ranges,
/// away from the pods (the scenarios use 192.0.2.1x and 2001:db8:2::1x).
const SERVICE_CIDR_V4: &str = "192.0.2.192/27";
const SERVICE_CIDR_V6: &str = "2001:db8:ff::/112";
/// The `kubernetes` Service's ClusterIPs: the first of each range.
const API_CLUSTER_IP_V4: &str = "192.0.2.193";
const API_CLUSTER_IP_V6: &str = "2001:db8:ff::1";

/// What runs the cluster's pods: nothing (the tests stand in for the
/// kubelets, and only the controllers cozy-proxy needs run), or real
/// kubelets (nodes/kubelet.rs), for which the API authorizes nodes, serves
/// the `kubernetes` Service's endpoints, and kube-scheduler and the
/// workload controllers run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workloads {
    StoodIn,
    Kubelets,
}

pub struct ControlPlane {
    pub ns: String,
    pub dir: PathBuf,
    etcd: Option<Proc>,
    apiserver: Option<Proc>,
    kcm: Option<Proc>,
    scheduler: Option<Proc>,
    kube_proxy: Option<Proc>,
    /// kube-proxy of each real node (its namespace's own).
    node_proxies: Vec<Proc>,
    workloads: Workloads,
    pub url: String,
    /// The admin's kubeconfig (for kubectl).
    pub admin: PathBuf,
    /// The address the API is served on.
    listen: String,
    port: u16,
    etcd_port: u16,
}

fn openssl(args: &[&str]) -> Result<()> {
    ok(&[&["openssl"], args].concat()).map(|_| ())
}

/// A CA, a serving certificate for 127.0.0.1 and `listen`, a
/// service-account key pair and the static tokens, in `dir`. The keys
/// and certificates are copies of those this process made for an
/// earlier control plane ([`made_certificates`]): each RSA key costs
/// openssl about 0.1 s of CPU, and every test starts a control plane.
fn certificates(dir: &Path, listen: &str) -> Result<()> {
    let (shared, serving) = made_certificates(listen)?;
    for f in ["ca.crt", "ca.key", "sa.key", "sa.pub"] {
        fs::copy(shared.join(f), dir.join(f)).with_context(|| format!("copying {f}"))?;
    }
    for f in ["server.crt", "server.key"] {
        fs::copy(serving.join(f), dir.join(f)).with_context(|| format!("copying {f}"))?;
    }
    // The admin, and each kubelet as the Node authorizer knows it.
    let mut tokens = format!("{ADMIN_TOKEN},admin,admin,\"system:masters\"\n");
    for k in 1..=MAX_KUBELETS {
        tokens += &format!(
            "{},system:node:node{k},node{k},\"system:nodes\"\n",
            node_token(&format!("node{k}"))
        );
    }
    fs::write(dir.join("tokens.csv"), tokens)?;
    Ok(())
}

/// The directories of this process's CA and service-account key pair,
/// and of its serving certificate for `listen`, made on first use: one
/// CA per process, one serving certificate per address served on. They
/// live in the temporary directory, under the process's id; those of
/// processes that have ended are removed when the first is made.
fn made_certificates(listen: &str) -> Result<(PathBuf, PathBuf)> {
    static MADE: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    const PREFIX: &str = "cozy-proxy-tests-certs-";
    let tmp = std::env::temp_dir();
    let shared = tmp.join(format!("{PREFIX}{}", std::process::id()));
    let serving = shared.join(listen);
    let mut made = MADE.lock().unwrap_or_else(PoisonError::into_inner);
    if made.is_empty() {
        for e in fs::read_dir(&tmp)?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let ended = name
                .strip_prefix(PREFIX)
                .is_some_and(|pid| !Path::new("/proc").join(pid).exists());
            if ended {
                let _ = fs::remove_dir_all(e.path());
            }
        }
        fs::create_dir_all(&shared)?;
        ca_and_service_account_keys(&shared)?;
    }
    if !made.contains(listen) {
        fs::create_dir_all(&serving)?;
        serving_certificate(&shared, &serving, listen)?;
        made.insert(listen.to_string());
    }
    Ok((shared, serving))
}

/// A CA and a service-account key pair, in `dir`.
fn ca_and_service_account_keys(dir: &Path) -> Result<()> {
    let p = |f: &str| dir.join(f).display().to_string();
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=cozy-proxy-tests-ca",
        "-keyout",
        &p("ca.key"),
        "-out",
        &p("ca.crt"),
    ])?;
    openssl(&["genrsa", "-out", &p("sa.key"), "2048"])?;
    openssl(&["rsa", "-in", &p("sa.key"), "-pubout", "-out", &p("sa.pub")])
}

/// A serving certificate for 127.0.0.1 and `listen`, signed by the CA in
/// `ca_dir`, in `dir`.
fn serving_certificate(ca_dir: &Path, dir: &Path, listen: &str) -> Result<()> {
    let p = |f: &str| dir.join(f).display().to_string();
    let ca = |f: &str| ca_dir.join(f).display().to_string();
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=kube-apiserver",
        "-keyout",
        &p("server.key"),
        "-out",
        &p("server.csr"),
    ])?;
    fs::write(
        dir.join("san.ext"),
        // The `kubernetes` Service's ClusterIPs and names too: pods reach
        // the API through them (the chart's DaemonSet on real nodes).
        format!(
            "subjectAltName=IP:127.0.0.1,IP:{listen},IP:{API_CLUSTER_IP_V4},IP:{API_CLUSTER_IP_V6},\
             DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\n"
        ),
    )?;
    openssl(&[
        "x509",
        "-req",
        "-in",
        &p("server.csr"),
        "-CA",
        &ca("ca.crt"),
        "-CAkey",
        &ca("ca.key"),
        "-CAserial",
        &p("ca.srl"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        &p("san.ext"),
        "-out",
        &p("server.crt"),
    ])
}

/// A control-plane component's API client flags: the admin's kubeconfig,
/// also for authenticating and authorizing its own callers.
fn client_args(admin: &str) -> [&str; 6] {
    [
        "--kubeconfig",
        admin,
        "--authentication-kubeconfig",
        admin,
        "--authorization-kubeconfig",
        admin,
    ]
}

/// A kubeconfig for `url` with this token, trusting the tests' CA.
pub fn kubeconfig(dir: &Path, url: &str, token: &str, name: &str) -> Result<PathBuf> {
    use base64::Engine as _;
    let ca = fs::read(dir.join("ca.crt"))?;
    let file = dir.join(format!("{name}.kubeconfig"));
    fs::write(
        &file,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: tests\n  cluster:\n    server: {url}\n    certificate-authority-data: {}\n\
             users:\n- name: {name}\n  user:\n    token: {token}\ncontexts:\n- name: tests\n  context: {{cluster: tests, user: {name}}}\n\
             current-context: tests\n",
            base64::engine::general_purpose::STANDARD.encode(&ca)
        ),
    )?;
    Ok(file)
}

impl ControlPlane {
    /// Starts etcd, kube-apiserver and kube-controller-manager in `ns`,
    /// state under `dir`; returns once the API answers on loopback.
    pub fn start(ns: &str, dir: PathBuf) -> Result<ControlPlane> {
        ControlPlane::start_on(ns, dir, "127.0.0.1")
    }

    /// The same, the API served on `listen`, an address of `ns` (other
    /// namespaces reach it there: the nodes of a cluster).
    pub fn start_on(ns: &str, dir: PathBuf, listen: &str) -> Result<ControlPlane> {
        ControlPlane::start_for(ns, dir, listen, Workloads::StoodIn)
    }

    /// The same, for `workloads`.
    pub fn start_for(
        ns: &str,
        dir: PathBuf,
        listen: &str,
        workloads: Workloads,
    ) -> Result<ControlPlane> {
        if !available() {
            bail!(
                "the Kubernetes binaries are not in {} (cargo xtask setup builds them)",
                bin_dir().display()
            );
        }
        fs::create_dir_all(&dir)?;
        certificates(&dir, listen)?;
        // Ports: the namespace is the test's own, so fixed ones are free.
        let (port, etcd_port) = (6443, 2379);
        let url = format!("https://{listen}:{port}");
        let admin = kubeconfig(&dir, &url, ADMIN_TOKEN, "admin")?;
        let mut cp = ControlPlane {
            ns: ns.into(),
            dir,
            etcd: None,
            apiserver: None,
            kcm: None,
            scheduler: None,
            kube_proxy: None,
            node_proxies: Vec::new(),
            workloads,
            url,
            admin,
            listen: listen.into(),
            port,
            etcd_port,
        };
        cp.start_etcd()?;
        cp.start_apiserver()?;
        cp.start_kcm()?;
        if workloads == Workloads::Kubelets {
            cp.start_scheduler()?;
        }
        Ok(cp)
    }

    fn log(&self, name: &str) -> Result<Stdio> {
        let f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{name}.log")))?;
        Ok(Stdio::from(f))
    }

    fn start_etcd(&mut self) -> Result<()> {
        let bin = bin_dir().join("etcd").display().to_string();
        let data = self.dir.join("etcd-data").display().to_string();
        let client = format!("http://127.0.0.1:{}", self.etcd_port);
        let peer = format!("http://127.0.0.1:{}", self.etcd_port + 1);
        let etcd = self.launch(
            "etcd",
            &[
                &bin,
                "--data-dir",
                &data,
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
                "--initial-cluster",
                &format!("default={peer}"),
                "--log-level",
                "warn",
            ],
            Duration::from_secs(20),
            || {
                ok_in(
                    &self.ns,
                    &[
                        "curl",
                        "-sSf",
                        "--max-time",
                        "1",
                        &format!("{client}/health"),
                    ],
                )
                .map(|_| ())
            },
        )?;
        self.etcd = Some(etcd);
        Ok(())
    }

    pub fn start_apiserver(&mut self) -> Result<()> {
        let bin = bin_dir().join("kube-apiserver").display().to_string();
        let d = |f: &str| self.dir.join(f).display().to_string();
        let args = vec![
            bin,
            "--etcd-servers".into(),
            format!("http://127.0.0.1:{}", self.etcd_port),
            "--bind-address".into(),
            self.listen.clone(),
            "--secure-port".into(),
            self.port.to_string(),
            "--advertise-address".into(),
            self.listen.clone(),
            "--tls-cert-file".into(),
            d("server.crt"),
            "--tls-private-key-file".into(),
            d("server.key"),
            "--client-ca-file".into(),
            d("ca.crt"),
            "--token-auth-file".into(),
            d("tokens.csv"),
            "--authorization-mode".into(),
            match self.workloads {
                Workloads::StoodIn => "RBAC".into(),
                Workloads::Kubelets => "Node,RBAC".into(),
            },
            "--service-account-issuer".into(),
            "https://kubernetes.default.svc".into(),
            "--service-account-key-file".into(),
            d("sa.pub"),
            "--service-account-signing-key-file".into(),
            d("sa.key"),
            "--service-cluster-ip-range".into(),
            format!("{SERVICE_CIDR_V4},{SERVICE_CIDR_V6}"),
            "--allow-privileged".into(),
            "--enable-priority-and-fairness=false".into(),
            // Endpoints for the `kubernetes` Service only where pods use it
            // (loopback cannot be one).
            match self.workloads {
                Workloads::StoodIn => "--endpoint-reconciler-type=none".into(),
                Workloads::Kubelets => "--endpoint-reconciler-type=lease".into(),
            },
            "--watch-cache=true".into(),
            // The kubelets (logs, exec) at their addresses: no DNS here.
            "--kubelet-preferred-address-types=InternalIP".into(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let apiserver = self.launch("kube-apiserver", &args, Duration::from_secs(60), || {
            let out = self.probe("/readyz")?;
            if out.trim() == "ok" {
                Ok(())
            } else {
                bail!("not ready: {out}")
            }
        })?;
        self.apiserver = Some(apiserver);
        Ok(())
    }

    /// Kills the API server (an outage; etcd keeps the state).
    pub fn stop_apiserver(&mut self) {
        if let Some(mut p) = self.apiserver.take() {
            p.kill(libc::SIGKILL);
            let _ = p.child.wait();
        }
    }

    fn start_kcm(&mut self) -> Result<()> {
        let bin = bin_dir()
            .join("kube-controller-manager")
            .display()
            .to_string();
        let admin = self.admin.display().to_string();
        let sa_key = self.dir.join("sa.key").display().to_string();
        let root_ca = self.dir.join("ca.crt").display().to_string();
        let mut controllers = String::from("endpointslice-controller,serviceaccount-controller,serviceaccount-token-controller,namespace-controller,garbage-collector-controller");
        if self.workloads == Workloads::Kubelets {
            controllers += ",daemonset-controller,deployment-controller,replicaset-controller,\
                root-ca-certificate-publisher-controller,pod-garbage-collector-controller,disruption-controller,\
                node-lifecycle-controller";
        }
        let mut args = vec![bin.as_str()];
        args.extend(client_args(&admin));
        args.extend([
            "--controllers",
            &controllers,
            "--bind-address",
            "127.0.0.1",
            "--secure-port",
            "10257",
            "--leader-elect=false",
            "--use-service-account-credentials=false",
            "--service-account-private-key-file",
            &sa_key,
            "--root-ca-file",
            &root_ca,
        ]);
        // Ready when the default ServiceAccount exists (its controller ran).
        let kcm = self.launch(
            "kube-controller-manager",
            &args,
            Duration::from_secs(60),
            || {
                self.probe("/api/v1/namespaces/default/serviceaccounts/default")
                    .map(|_| ())
            },
        )?;
        self.kcm = Some(kcm);
        Ok(())
    }

    fn start_scheduler(&mut self) -> Result<()> {
        let bin = bin_dir().join("kube-scheduler").display().to_string();
        let admin = self.admin.display().to_string();
        let mut args = vec![bin.as_str()];
        args.extend(client_args(&admin));
        args.extend([
            "--leader-elect=false",
            "--bind-address",
            "127.0.0.1",
            "--secure-port",
            "10259",
        ]);
        let scheduler = self.launch("kube-scheduler", &args, Duration::from_secs(60), || {
            ok_in(
                &self.ns,
                &[
                    "curl",
                    "-skf",
                    "--max-time",
                    "1",
                    "https://127.0.0.1:10259/healthz",
                ],
            )
            .map(|_| ())
        })?;
        self.scheduler = Some(scheduler);
        Ok(())
    }

    /// A kubeconfig for kubelet `node` (its static token).
    pub fn node_kubeconfig(&self, node: &str) -> Result<PathBuf> {
        kubeconfig(&self.dir, &self.url, &node_token(node), node)
    }

    /// Starts component `name` in the namespace (its output in
    /// `<name>.log`) and waits until `ready` succeeds within `within`; the
    /// error carries the end of its log.
    fn launch(
        &self,
        name: &str,
        args: &[&str],
        within: Duration,
        ready: impl FnMut() -> Result<()>,
    ) -> Result<Proc> {
        let proc = Proc::spawn_in(&self.ns, args, Stdio::null(), self.log(name)?)?;
        eventually(within, ready).with_context(|| {
            format!(
                "{name} did not become ready within {within:?}:\n{}",
                self.log_tail(name)
            )
        })?;
        Ok(proc)
    }

    /// The last lines of a component's log, for an error message.
    pub fn log_tail(&self, name: &str) -> String {
        crate::sh::tail(&self.dir.join(format!("{name}.log")), 30)
    }

    /// Starts the real kube-proxy in nftables mode for `node` in this
    /// namespace (the node's), as a cluster runs it beside cozy-proxy.
    /// It waits for its Node to have an address (`set_node_address`).
    pub fn start_kube_proxy(&mut self, node: &str) -> Result<()> {
        let ns = self.ns.clone();
        let proc = self.kube_proxy_in(&ns, node, &self.dir.join("kube-proxy.log"))?;
        self.kube_proxy = Some(proc);
        Ok(())
    }

    /// The same in real node `node`'s namespace `ns`, its log in
    /// `kube-proxy-<node>.log`.
    pub fn start_node_kube_proxy(&mut self, ns: &str, node: &str) -> Result<()> {
        let log = self.dir.join(format!("kube-proxy-{node}.log"));
        let proc = self.kube_proxy_in(ns, node, &log)?;
        self.node_proxies.push(proc);
        Ok(())
    }

    fn kube_proxy_in(&self, ns: &str, node: &str, log: &Path) -> Result<Proc> {
        let bin = bin_dir().join("kube-proxy").display().to_string();
        let admin = self.admin.display().to_string();
        let args = [
            bin.as_str(),
            "--kubeconfig",
            &admin,
            "--hostname-override",
            node,
            "--proxy-mode",
            "nftables",
            // Leaves the host's conntrack table size alone.
            "--conntrack-max-per-core=0",
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--healthz-bind-address",
            "127.0.0.1:10256",
        ];
        let out = fs::OpenOptions::new().create(true).append(true).open(log)?;
        let proc = Proc::spawn_in(ns, &args, Stdio::null(), Stdio::from(out))?;
        let within = Duration::from_secs(30);
        eventually(within, || {
            ok_in(ns, &["nft", "list", "table", "ip", "kube-proxy"]).map(|_| ())
        })
        .with_context(|| {
            format!(
                "kube-proxy did not become ready within {within:?}:\n{}",
                crate::sh::tail(log, 30)
            )
        })?;
        Ok(proc)
    }

    /// Changes the rules of ClusterRole `name` (as an operator editing it
    /// would): `edit` gets them as JSON; the result replaces the role.
    pub fn edit_cluster_role(
        &self,
        name: &str,
        edit: impl FnOnce(&mut Vec<serde_json::Value>) -> Result<()>,
    ) -> Result<()> {
        let role = self.kubectl(&["get", "clusterrole", name, "-o", "json"])?;
        let mut role: serde_json::Value = serde_json::from_str(&role)?;
        edit(role["rules"].as_array_mut().context("the role's rules")?)?;
        let admin = self.admin.display().to_string();
        let out = crate::sh::feed_in(
            &self.ns,
            &["kubectl", "--kubeconfig", &admin, "replace", "-f", "-"],
            role.to_string().as_bytes(),
            20,
        )?;
        if !out.status.success() {
            bail!("kubectl replace: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// GET `path` of the API as the admin, failing on an HTTP error: the
    /// readiness probes, polled every 100 ms. They use curl, not kubectl:
    /// each kubectl costs about 0.1 s of CPU to start.
    fn probe(&self, path: &str) -> Result<String> {
        let ca = self.dir.join("ca.crt").display().to_string();
        let auth = format!("Authorization: Bearer {ADMIN_TOKEN}");
        let url = format!("{}{path}", self.url);
        ok_in(
            &self.ns,
            &[
                "curl",
                "-sSf",
                "--max-time",
                "2",
                "--cacert",
                &ca,
                "-H",
                &auth,
                &url,
            ],
        )
    }

    /// `kubectl` as the admin, in the namespace; its output.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        let admin = self.admin.display().to_string();
        let mut full = vec!["kubectl", "--kubeconfig", &admin, "--request-timeout=5s"];
        full.extend_from_slice(args);
        ok_in(&self.ns, &full)
    }

    /// `kubectl apply -f -` of `yaml`, as the admin.
    pub fn apply(&self, yaml: &str) -> Result<()> {
        let admin = self.admin.display().to_string();
        let out = crate::sh::feed_in(
            &self.ns,
            &[
                "kubectl",
                "--kubeconfig",
                &admin,
                "apply",
                "--server-side",
                "--force-conflicts",
                "-f",
                "-",
            ],
            yaml.as_bytes(),
            20,
        )?;
        if !out.status.success() {
            bail!("kubectl apply: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// cozy-proxy's source arguments as the chart runs it: the token of
    /// its ServiceAccount (bound to exactly the chart's roles), and its
    /// DaemonSet.
    pub fn controller_args(&self) -> Result<Vec<String>> {
        let kubeconfig = self.service_account_kubeconfig(RELEASE_NAMESPACE, "cozy-proxy")?;
        Ok(vec![
            "--kubeconfig".to_string(),
            kubeconfig.display().to_string(),
            "--daemonset".to_string(),
            format!("{RELEASE_NAMESPACE}/cozy-proxy"),
        ])
    }

    /// A kubeconfig with a token of ServiceAccount `namespace/name`.
    pub fn service_account_kubeconfig(&self, namespace: &str, name: &str) -> Result<PathBuf> {
        let token =
            self.kubectl(&["create", "token", name, "-n", namespace, "--duration", "2h"])?;
        kubeconfig(
            &self.dir,
            &self.url,
            token.trim(),
            &format!("sa-{namespace}-{name}"),
        )
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let mut procs: Vec<Proc> = self.node_proxies.drain(..).collect();
        procs.extend(
            [
                self.kube_proxy.take(),
                self.scheduler.take(),
                self.kcm.take(),
                self.apiserver.take(),
                self.etcd.take(),
            ]
            .into_iter()
            .flatten(),
        );
        for mut p in procs {
            p.kill(libc::SIGKILL);
            let _ = p.child.wait();
        }
        // COZY_PROXY_KEEP_K8S=1 keeps the logs and state for a post-mortem.
        if std::env::var_os("COZY_PROXY_KEEP_K8S").is_none() {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// The namespace the chart is installed in.
pub const RELEASE_NAMESPACE: &str = "kube-system";
/// The helm release the tests install.
pub const RELEASE: &str = "cozy-proxy";
/// The label tying the test Pods to their Service's selector.
pub const SELECTOR_LABEL: &str = "cozy-proxy-tests/service";

/// A test node's Node object, with its InternalIP if given (a kubelet
/// publishes it in the status).
pub fn node_yaml(name: &str, address: Option<std::net::IpAddr>) -> String {
    let mut y = format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  labels:\n    kubernetes.io/hostname: {name}\n"
    );
    if let Some(a) = address {
        y += &format!("status:\n  addresses:\n  - {{type: InternalIP, address: \"{a}\"}}\n");
    }
    y
}

/// The ServiceCIDR kube-apiserver creates for its service range.
pub fn service_cidr_yaml() -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata:\n  name: kubernetes\nspec:\n  cidrs: [\"{SERVICE_CIDR_V4}\", \"{SERVICE_CIDR_V6}\"]\n"
    )
}

/// The port a Service written without any gets through the API (a
/// LoadBalancer Service must list one).
const PLACEHOLDER_PORT: u16 = 80;

/// The chart's directory in this workspace.
pub fn chart_dir() -> PathBuf {
    crate::workspace().join("charts/cozy-proxy")
}

/// A Pod's name for an endpoint address: one Pod per address, so that an
/// endpoint that moves is a Pod that goes and another that comes.
fn pod_name(service: &str, address: &str) -> String {
    let tail: String = address
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    format!("{service}-{}", tail.trim_matches('-'))
}

/// The Service as a user creates it through the API: the manifest's
/// labels, annotations, source ranges and ports, plus a selector for the
/// test Pods (the real EndpointSlice controller makes the slices from
/// them). A LoadBalancer needs a port: a Service without any gets
/// [`PLACEHOLDER_PORT`] (passthrough ignores it; `put_service` returns it).
pub fn api_service_yaml(svc: &Svc, address_type: &str) -> String {
    format!("{:#}\n", api_service(svc, address_type))
}

/// [`api_service_yaml`] as a value, for a test to add to.
pub fn api_service(svc: &Svc, address_type: &str) -> Value {
    let family = if address_type == "IPv6" {
        "IPv6"
    } else {
        "IPv4"
    };
    let mut ports: Vec<Value> = (svc.ports.iter().enumerate())
        .map(|(i, (proto, port))| json!({"name": format!("p{i}"), "port": port, "protocol": proto}))
        .collect();
    if ports.is_empty() {
        ports.push(json!({"name": "p0", "port": PLACEHOLDER_PORT, "protocol": "TCP"}));
    }
    let mut spec = json!({
        "type": "LoadBalancer",
        "allocateLoadBalancerNodePorts": false,
        "ipFamilyPolicy": "SingleStack",
        "ipFamilies": [family],
        "selector": {SELECTOR_LABEL: svc.name},
        "ports": ports,
    });
    if !svc.source_ranges.is_empty() {
        spec["loadBalancerSourceRanges"] = json!(svc.source_ranges);
    }
    let mut service = svc.value();
    service["spec"] = spec;
    if let Some(fields) = service.as_object_mut() {
        // Set by a load-balancer controller, through the status.
        fields.remove("status");
    }
    service
}

impl ControlPlane {
    /// The chart installed by the real `helm upgrade --install` for
    /// `backend`: its ServiceAccount, exactly its ClusterRole/Role and
    /// bindings, and its DaemonSet (no kubelet runs it here; its presence
    /// tells a stopping cozy-proxy that this is a restart, not an
    /// uninstall), as release [`RELEASE`]. Again: an upgrade, which puts
    /// back what was changed by hand.
    pub fn install_chart(&self, backend: &str) -> Result<()> {
        self.install_chart_with(backend, &[])
    }

    /// The same with more values (`--set` each of `values`).
    pub fn install_chart_with(&self, backend: &str, values: &[String]) -> Result<()> {
        let chart = chart_dir().display().to_string();
        let backend = format!("backend={backend}");
        let mut args = vec!["upgrade", "--install", RELEASE, &chart, "--set", &backend];
        for v in values {
            args.extend(["--set", v.as_str()]);
        }
        self.helm(&args)
            .map(|_| ())
            .context("helm upgrade --install (cargo xtask setup installs helm)")
    }

    /// `helm ARGS` as the admin, in the release's namespace.
    pub fn helm(&self, args: &[&str]) -> Result<String> {
        let admin = self.admin.display().to_string();
        let mut full = vec![
            "helm",
            "--kubeconfig",
            &admin,
            "--namespace",
            RELEASE_NAMESPACE,
        ];
        full.extend_from_slice(args);
        ok_in(&self.ns, &full)
    }

    /// The Node object of a test node (the EndpointSlice controller skips
    /// Pods whose Node does not exist).
    pub fn create_node(&self, name: &str) -> Result<()> {
        self.apply(&node_yaml(name, None))
    }

    /// Publishes the Node's InternalIP, as its kubelet would.
    pub fn set_node_address(&self, name: &str, address: std::net::IpAddr) -> Result<()> {
        let status = serde_json::json!({"status": {"addresses": [
            {"type": "InternalIP", "address": address.to_string()}
        ]}});
        self.patch_status("node", name, None, &status)
    }

    /// Merges `status` into the status of `kind/name` (in `namespace`),
    /// as the object's own controller (kubelet, load balancer) would.
    pub fn patch_status(
        &self,
        kind: &str,
        name: &str,
        namespace: Option<&str>,
        status: &serde_json::Value,
    ) -> Result<()> {
        let status = status.to_string();
        let mut args = vec!["patch", kind, name];
        if let Some(ns) = namespace {
            args.extend(["-n", ns]);
        }
        args.extend(["--subresource=status", "--type=merge", "-p", &status]);
        self.kubectl(&args).map(|_| ())
    }

    /// Creates or updates a Service and its endpoints through the API, as
    /// users and controllers do: the Service with `kubectl apply`, its
    /// LoadBalancer status patched (a load-balancer controller's job),
    /// one Pod per endpoint on `node` with its status patched to the
    /// address and readiness (a kubelet's job), Pods no longer listed
    /// deleted. `endpoints`: `(address, ready)`, `None` = ready. Returns
    /// the Service as the API holds it: its real creationTimestamp (which
    /// decides conflicts) in place of the manifest's.
    pub fn put_service(
        &self,
        svc: &Svc,
        address_type: &str,
        endpoints: &[(String, Option<bool>)],
        node: &str,
    ) -> Result<Svc> {
        self.apply(&api_service_yaml(svc, address_type))?;
        let status = json!({"status": svc.value()["status"]});
        self.patch_status("service", &svc.name, Some("default"), &status)?;
        let wanted: Vec<String> = endpoints
            .iter()
            .map(|(a, _)| pod_name(&svc.name, a))
            .collect();
        for name in self.pods_of(&svc.name)? {
            if !wanted.contains(&name) {
                self.delete_pod(&name)?;
            }
        }
        for ((address, ready), name) in endpoints.iter().zip(&wanted) {
            self.apply(&format!(
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: default\n  labels:\n    {SELECTOR_LABEL}: {}\n\
                 spec:\n  nodeName: {node}\n  containers:\n  - {{name: vm, image: registry.invalid/vm:1}}\n",
                svc.name
            ))?;
            let ready = if ready.unwrap_or(true) {
                "True"
            } else {
                "False"
            };
            let status = serde_json::json!({"status": {
                "phase": "Running",
                "podIP": address,
                "podIPs": [{"ip": address}],
                "conditions": [{"type": "Ready", "status": ready}],
            }});
            self.patch_status("pod", name, Some("default"), &status)?;
        }
        let created = self.kubectl(&[
            "get",
            "service",
            &svc.name,
            "-n",
            "default",
            "-o",
            "jsonpath={.metadata.creationTimestamp}",
        ])?;
        let mut held = svc.clone().created(created.trim());
        if held.ports.is_empty() {
            held.ports = vec![("TCP".into(), PLACEHOLDER_PORT.into())];
        }
        Ok(held)
    }

    /// Waits until the EndpointSlice controller lists `address` as a
    /// ready endpoint of `service` (after an API server restart it first
    /// has to find the server again, with its own backoff).
    pub fn wait_ready_endpoint(
        &self,
        service: &str,
        address: &str,
        within: Duration,
    ) -> Result<()> {
        eventually(within, || {
            let out = self.endpoints_of(service, "{.addresses[0]} {.conditions.ready}")?;
            if out.iter().any(|l| l.trim() == format!("{address} true")) {
                Ok(())
            } else {
                bail!("no ready endpoint {address} for {service}: {out:?}")
            }
        })
        .with_context(|| self.log_tail("kube-controller-manager"))
    }

    /// One line per endpoint of `service`'s EndpointSlices: `fields`, a
    /// jsonpath template over an endpoint.
    pub fn endpoints_of(&self, service: &str, fields: &str) -> Result<Vec<String>> {
        let out = self.kubectl(&[
            "get",
            "endpointslices",
            "-n",
            "default",
            "-l",
            &format!("kubernetes.io/service-name={service}"),
            "-o",
            &format!("jsonpath={{range .items[*].endpoints[*]}}{fields}{{\"\\n\"}}{{end}}"),
        ])?;
        Ok(out.lines().map(str::to_string).collect())
    }

    /// Deletes a Service and its Pods.
    pub fn delete_service(&self, name: &str) -> Result<()> {
        self.kubectl(&["delete", "service", name, "-n", "default", "--wait=false"])?;
        for pod in self.pods_of(name)? {
            self.delete_pod(&pod)?;
        }
        Ok(())
    }

    /// The names of the test Pods selected by Service `service`.
    pub fn pods_of(&self, service: &str) -> Result<Vec<String>> {
        let out = self.kubectl(&[
            "get",
            "pods",
            "-n",
            "default",
            "-l",
            &format!("{SELECTOR_LABEL}={service}"),
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ])?;
        Ok(out.split_whitespace().map(str::to_string).collect())
    }

    /// No kubelet confirms a Pod's end here: deleted at once.
    pub fn delete_pod(&self, name: &str) -> Result<()> {
        self.kubectl(&[
            "delete",
            "pod",
            name,
            "-n",
            "default",
            "--grace-period=0",
            "--force",
            "--wait=false",
        ])
        .map(|_| ())
    }

    /// The Events cozy-proxy wrote on `default/<service>`, as `reason: note`
    /// lines.
    pub fn events_of(&self, service: &str) -> Result<Vec<String>> {
        self.events_in("default", service)
    }

    /// The Events cozy-proxy wrote on `namespace/<service>`, as
    /// `reason: note` lines.
    pub fn events_in(&self, namespace: &str, service: &str) -> Result<Vec<String>> {
        let out = self.kubectl(&[
            "get",
            "events",
            "-n",
            namespace,
            "--field-selector",
            &format!("involvedObject.name={service},involvedObject.kind=Service"),
            "-o",
            "json",
        ])?;
        let v: serde_json::Value = serde_json::from_str(&out).context("kubectl get events")?;
        Ok(v["items"]
            .as_array()
            .into_iter()
            .flatten()
            // Only ours: the API server's own controllers write Events on
            // Services too (its ClusterIP repair loop, in a fresh cluster).
            .filter(|e| e["reportingComponent"] == "cozy-proxy")
            .map(|e| {
                format!(
                    "{}: {}",
                    e["reason"].as_str().unwrap_or(""),
                    e["message"].as_str().unwrap_or("")
                )
            })
            .collect())
    }

    /// Compacts etcd's history up to its current revision, after writing
    /// `writes` keys outside Kubernetes' prefix (etcd's JSON gateway): a
    /// watch resumed from an older resourceVersion then gets 410 Gone.
    pub fn compact_etcd(&self, writes: usize) -> Result<()> {
        use base64::Engine as _;
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let gateway = format!("http://127.0.0.1:{}/v3", self.etcd_port);
        let post = |path: &str, body: &serde_json::Value| {
            ok_in(
                &self.ns,
                &[
                    "curl",
                    "-sSf",
                    "--max-time",
                    "5",
                    "-X",
                    "POST",
                    "-d",
                    &body.to_string(),
                    &format!("{gateway}{path}"),
                ],
            )
        };
        let mut revision = String::new();
        for i in 0..writes.max(1) {
            let out = post(
                "/kv/put",
                &serde_json::json!({"key": b64("/cozy-proxy-tests/filler"), "value": b64(&i.to_string())}),
            )?;
            let v: serde_json::Value = serde_json::from_str(&out).context("etcd put")?;
            revision = v["header"]["revision"]
                .as_str()
                .context("etcd revision")?
                .to_string();
        }
        post(
            "/kv/compaction",
            &serde_json::json!({"revision": revision, "physical": true}),
        )?;
        Ok(())
    }
}

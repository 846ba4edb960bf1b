//! The container image and the container, for real: the image is built
//! from the binary under test by xtask's builder (`xtask image-of`, the
//! one `cargo xtask image` uses), and run with runc on an OCI bundle
//! unpacked by umoci, under the security settings the chart's DaemonSet
//! asks for (read from the real `helm template` output): the
//! capabilities, a read-only root, no privilege escalation, the host's
//! network (runc starts in the test node's namespace and gets no network
//! namespace of its own), the pin directory's mount, and a seccomp
//! profile.
use crate::sh::ok;
use anyhow::{bail, Context, Result};
use k8s_openapi::api::apps::v1::DaemonSet;
use serde_json::{json, Value};
use std::{
    fs,
    path::{Path, PathBuf},
};

/// Unpacks image `tag` of `archive` into `bundle/rootfs` (umoci).
pub fn unpack(archive: &Path, tag: &str, bundle: &Path) -> Result<PathBuf> {
    let layout = bundle.join("layout");
    let rootfs = bundle.join("rootfs");
    let _ = fs::remove_dir_all(bundle);
    fs::create_dir_all(&layout)?;
    ok(&[
        "tar",
        "-xf",
        &archive.display().to_string(),
        "-C",
        &layout.display().to_string(),
    ])?;
    ok(&[
        "umoci",
        "raw",
        "unpack",
        "--image",
        &format!("{}:{tag}", layout.display()),
        &rootfs.display().to_string(),
    ])?;
    let _ = fs::remove_dir_all(&layout);
    Ok(rootfs)
}

/// What the chart's DaemonSet asks of the container runtime.
#[derive(Clone, Debug)]
pub struct Security {
    /// Capabilities added after dropping ALL, as `CAP_*`.
    pub capabilities: Vec<String>,
    pub read_only_root: bool,
    pub no_new_privileges: bool,
    pub privileged: bool,
    /// `seccompProfile.type` (and `localhostProfile`, if any).
    pub seccomp: (String, Option<String>),
    /// The container's arguments (after the image's entrypoint).
    pub args: Vec<String>,
    /// Where the chart mounts the host's pin directory, if it does.
    pub pins_mount: Option<String>,
}

/// The security settings of the chart's DaemonSet's main container as the
/// real `helm template` renders them for `backend`.
pub fn chart_security(backend: &str) -> Result<Security> {
    chart_container_security(backend, "cozy-proxy")
}

/// The same for the chart's container (or init container) `name`.
pub fn chart_container_security(backend: &str, name: &str) -> Result<Security> {
    let chart = crate::control_plane::k8s::chart_dir().display().to_string();
    let rendered = ok(&[
        "helm",
        "template",
        "cozy-proxy",
        &chart,
        "--set",
        &format!("backend={backend}"),
    ])?;
    let ds: DaemonSet = rendered
        .split("\n---")
        .filter(|doc| doc.contains("kind: DaemonSet"))
        .map(serde_yaml::from_str)
        .next()
        .context("no DaemonSet in the chart")??;
    let pod = ds
        .spec
        .and_then(|s| s.template.spec)
        .context("DaemonSet pod spec")?;
    let container = pod
        .containers
        .iter()
        .chain(pod.init_containers.iter().flatten())
        .find(|c| c.name == name)
        .with_context(|| format!("no container {name} in the chart"))?;
    let sc = container
        .security_context
        .clone()
        .context("securityContext")?;
    let caps = sc.capabilities.clone().unwrap_or_default();
    if caps.drop.unwrap_or_default() != ["ALL"] {
        bail!("the chart does not drop ALL capabilities");
    }
    let seccomp = sc.seccomp_profile.clone().context("seccompProfile")?;
    let pins_mount = container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "bpf-pins")
        .map(|m| m.mount_path.clone());
    Ok(Security {
        capabilities: caps
            .add
            .unwrap_or_default()
            .iter()
            .map(|c| format!("CAP_{c}"))
            .collect(),
        read_only_root: sc.read_only_root_filesystem == Some(true),
        no_new_privileges: sc.allow_privilege_escalation == Some(false),
        privileged: sc.privileged == Some(true),
        seccomp: (seccomp.type_, seccomp.localhost_profile),
        args: container.args.clone().unwrap_or_default(),
        pins_mount,
    })
}

/// A host directory bound into the container.
#[derive(Clone, Debug)]
pub struct Bind {
    pub source: PathBuf,
    pub destination: PathBuf,
    pub read_only: bool,
}

/// The OCI runtime configuration of the container: `args` as the process
/// (args[0] is the image's `/cozy-proxy`), `security` applied, `seccomp`
/// as the runtime-spec profile (`None`: Unconfined), the host's pin
/// directory (`host_pins`) at the chart's mount path, `binds` at their own
/// paths.
/// Namespaces: pid, ipc, uts, mount of its own; the network namespace
/// `netns` joined (the pod runs with hostNetwork: the node's; `None`: the
/// host's). No rlimits (the sandbox refuses to set them).
pub fn config(
    netns: Option<&Path>,
    args: &[String],
    security: &Security,
    seccomp: Option<&Value>,
    host_pins: Option<&Path>,
    binds: &[Bind],
) -> Result<Value> {
    if security.privileged {
        bail!("the chart runs the container privileged");
    }
    let caps = &security.capabilities;
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
               "options": ["nosuid", "noexec", "nodev", "ro"]}),
        json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "nodev", "size=16m"]}),
    ];
    if let (Some(host), Some(at)) = (host_pins, &security.pins_mount) {
        mounts.push(json!({"destination": at, "type": "bind",
            "source": host.display().to_string(), "options": ["rbind"]}));
    }
    for b in binds {
        let mut options = vec!["rbind"];
        if b.read_only {
            options.push("ro");
        }
        mounts.push(
            json!({"destination": b.destination.display().to_string(), "type": "bind",
            "source": b.source.display().to_string(), "options": options}),
        );
    }
    let mut namespaces = vec![
        json!({"type": "pid"}),
        json!({"type": "ipc"}),
        json!({"type": "uts"}),
        json!({"type": "mount"}),
    ];
    if let Some(ns) = netns {
        namespaces.push(json!({"type": "network", "path": ns.display().to_string()}));
    }
    let mut linux = json!({
        "namespaces": namespaces,
        "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
        "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
    });
    if let Some(profile) = seccomp {
        linux["seccomp"] = profile.clone();
    }
    Ok(json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": ["PATH=/", "RUST_BACKTRACE=1"],
            "cwd": "/",
            "capabilities": {
                "bounding": caps, "effective": caps, "permitted": caps,
            },
            "noNewPrivileges": security.no_new_privileges,
        },
        "root": {"path": "rootfs", "readonly": security.read_only_root},
        "hostname": "cozy-proxy",
        "mounts": mounts,
        "linux": linux,
    }))
}

/// A seccomp profile in the Docker/containers-common format (`names`,
/// `includes`/`excludes` by capability, `archMap`), resolved for a
/// container holding `capabilities` into the runtime-spec format runc
/// takes, as container runtimes do.
pub fn resolve_profile(profile: &Value, capabilities: &[String]) -> Result<Value> {
    let has = |list: &Value| -> Vec<bool> {
        list.as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(|c| capabilities.iter().any(|h| h == c))
            .collect()
    };
    let mut syscalls = Vec::new();
    for rule in profile["syscalls"].as_array().context("syscalls")? {
        let includes = has(&rule["includes"]["caps"]);
        let excludes = has(&rule["excludes"]["caps"]);
        // A rule for other architectures or kernels is left out, as a
        // runtime on x86_64 with a recent kernel does.
        let arch_ok = rule["includes"]["arches"].as_array().is_none_or(|a| {
            a.iter()
                .any(|x| x == "amd64" || x == "x86_64" || x == "x32")
        }) && !rule["excludes"]["arches"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x == "amd64"));
        if includes.contains(&false) || excludes.contains(&true) || !arch_ok {
            continue;
        }
        let mut r = json!({"names": rule["names"], "action": rule["action"]});
        if let Some(args) = rule["args"].as_array().filter(|a| !a.is_empty()) {
            r["args"] = Value::Array(args.clone());
        }
        if let Some(errno) = rule["errnoRet"].as_u64() {
            r["errnoRet"] = json!(errno);
        }
        syscalls.push(r);
    }
    let mut out = json!({
        "defaultAction": profile["defaultAction"],
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": syscalls,
    });
    if let Some(errno) = profile["defaultErrnoRet"].as_u64() {
        out["defaultErrnoRet"] = json!(errno);
    }
    Ok(out)
}

/// `profile` (runtime-spec format) with `calls` allowed: taken out of
/// every other rule (the runtime default answers them with EPERM unless
/// CAP_SYS_ADMIN, and a later rule for the same call does not override
/// that one), then allowed by a rule of their own.
pub fn allowing(profile: &Value, calls: &[&str]) -> Result<Value> {
    let mut out = profile.clone();
    let rules = out["syscalls"].as_array_mut().context("syscalls")?;
    for rule in rules.iter_mut() {
        if let Some(names) = rule["names"].as_array_mut() {
            names.retain(|n| !calls.iter().any(|c| n == c));
        }
    }
    rules.retain(|r| r["names"].as_array().is_some_and(|n| !n.is_empty()));
    rules.push(json!({"names": calls, "action": "SCMP_ACT_ALLOW"}));
    Ok(out)
}

/// How a controller runs as a container: the bundle and its settings.
#[derive(Clone, Debug)]
pub struct Container {
    /// The bundle directory (holds `rootfs/`; `config.json` is written at
    /// each start).
    pub bundle: PathBuf,
    /// runc's name for it (unique per test).
    pub id: String,
    pub security: Security,
    /// Runtime-spec seccomp profile; `None` for Unconfined.
    pub seccomp: Option<Value>,
    /// The host's pin directory (a hostPath `DirectoryOrCreate`).
    pub host_pins: Option<PathBuf>,
    pub binds: Vec<Bind>,
}

impl Container {
    /// Writes `config.json` for `args` (args[0] is replaced by the image's
    /// binary) in network namespace `ns` and returns the runc command line
    /// to run it in the foreground, from the host (runc forwards signals;
    /// its exit status is the process's).
    pub fn command(&self, ns: Option<&str>, args: &[&str]) -> Result<Vec<String>> {
        // The host's pin directory is at the chart's mount path inside.
        let inside = |a: &str| -> String {
            match (&self.host_pins, &self.security.pins_mount) {
                (Some(host), Some(at)) => match Path::new(a).strip_prefix(host) {
                    Ok(rest) => Path::new(at).join(rest).display().to_string(),
                    Err(_) => a.to_string(),
                },
                _ => a.to_string(),
            }
        };
        let mut process: Vec<String> = vec!["/cozy-proxy".into()];
        process.extend(args.iter().skip(1).map(|a| inside(a)));
        let netns = ns.map(|n| Path::new("/var/run/netns").join(n));
        let cfg = config(
            netns.as_deref(),
            &process,
            &self.security,
            self.seccomp.as_ref(),
            self.host_pins.as_deref(),
            &self.binds,
        )?;
        fs::write(
            self.bundle.join("config.json"),
            serde_json::to_vec_pretty(&cfg)?,
        )?;
        self.remove();
        Ok(vec![
            "runc".into(),
            "run".into(),
            "--bundle".into(),
            self.bundle.display().to_string(),
            self.id.clone(),
        ])
    }

    /// Forgets the container in runc (after it stopped, or to clear one a
    /// crashed test left).
    pub fn remove(&self) {
        let _ = ok(&["runc", "delete", "--force", &self.id]);
    }

    /// Removes the container and its bundle.
    pub fn discard(&self) {
        self.remove();
        let _ = fs::remove_dir_all(&self.bundle);
    }
}

/// The seccomp profile a test runs the container under.
#[derive(Clone, Debug)]
pub enum SeccompChoice {
    /// No filter.
    Unconfined,
    /// The runtime default of the runtime used here: containers-common's
    /// profile (CRI-O's and podman's default; `/usr/share/containers/
    /// seccomp.json`), resolved for the container's capabilities.
    RuntimeDefault,
    /// A profile shipped with the chart (`charts/cozy-proxy/files/NAME`),
    /// already in the runtime-spec format (what a kubelet `Localhost`
    /// profile is).
    Localhost(String),
}

/// containers-common's default profile (installed with buildah).
pub const RUNTIME_DEFAULT_PROFILE: &str = "/usr/share/containers/seccomp.json";

impl SeccompChoice {
    /// What the chart's `seccompProfile` names.
    pub fn of_chart(security: &Security) -> Result<SeccompChoice> {
        Ok(match security.seccomp.0.as_str() {
            "Unconfined" => SeccompChoice::Unconfined,
            "RuntimeDefault" => SeccompChoice::RuntimeDefault,
            "Localhost" => {
                let path = security.seccomp.1.clone().context("localhostProfile")?;
                let name = Path::new(&path)
                    .file_name()
                    .context("profile file name")?
                    .to_string_lossy()
                    .to_string();
                SeccompChoice::Localhost(name)
            }
            other => bail!("unknown seccompProfile type {other}"),
        })
    }

    /// The runtime-spec profile (`None`: Unconfined).
    pub fn profile(&self, capabilities: &[String]) -> Result<Option<Value>> {
        Ok(match self {
            SeccompChoice::Unconfined => None,
            SeccompChoice::RuntimeDefault => {
                let text = fs::read_to_string(RUNTIME_DEFAULT_PROFILE).with_context(|| {
                    format!("{RUNTIME_DEFAULT_PROFILE} (cargo xtask setup installs it)")
                })?;
                Some(resolve_profile(
                    &serde_json::from_str(&text)?,
                    capabilities,
                )?)
            }
            SeccompChoice::Localhost(name) => {
                let path = crate::control_plane::k8s::chart_dir()
                    .join("files")
                    .join(name);
                let text = fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?;
                Some(serde_json::from_str(&text)?)
            }
        })
    }
}

/// The image of the binary under test, built once per test process.
pub fn test_image() -> Result<PathBuf> {
    static IMAGE: std::sync::OnceLock<std::result::Result<PathBuf, String>> =
        std::sync::OnceLock::new();
    IMAGE
        .get_or_init(|| {
            let archive = std::env::temp_dir().join("cozy-proxy-test-image.oci.tar");
            build(Path::new(&crate::bin()), &archive)
                .map(|_| archive)
                .map_err(|e| format!("{e:#}"))
        })
        .clone()
        .map_err(|e| anyhow::anyhow!("building the test image: {e}"))
}

/// Builds the test image of `binary` into `archive` the way `cargo
/// xtask image` builds the release one: with xtask's builder (`xtask
/// image-of`). The xtask binary `cargo xtask test` built is used; without
/// one, cargo builds it into a target directory of its own (the running
/// `cargo test` holds the lock of its own).
fn build(binary: &Path, archive: &Path) -> Result<()> {
    let (binary, archive) = (binary.display().to_string(), archive.display().to_string());
    let image_of = ["image-of", &binary, &archive, TEST_TAG];
    if let Some(xtask) = crate::built_beside("xtask") {
        let mut args = vec![xtask.to_str().context("xtask's path")?];
        args.extend(image_of);
        return ok(&args).map(|_| ());
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target = crate::workspace().join("target/xtask-image");
    let target = target.display().to_string();
    let mut args = vec![
        &cargo[..],
        "run",
        "-q",
        "-p",
        "xtask",
        "--target-dir",
        &target,
        "--",
    ];
    args.extend(image_of);
    ok(&args).map(|_| ())
}

/// The reference name of the test image in its archive.
pub const TEST_TAG: &str = "test";

/// The test image unpacked into `bundle`; its rootfs.
pub fn test_bundle(bundle: &Path) -> Result<PathBuf> {
    unpack(&test_image()?, TEST_TAG, bundle)
}

/// A container of the test image for `backend` with the chart's security
/// settings, unpacked into `bundle`; `seccomp` overrides the chart's.
pub fn container(
    backend: &str,
    bundle: &Path,
    id: &str,
    seccomp: Option<SeccompChoice>,
    host_pins: &Path,
    binds: Vec<Bind>,
) -> Result<Container> {
    let security = chart_security(backend)?;
    let choice = match seccomp {
        Some(c) => c,
        None => SeccompChoice::of_chart(&security)?,
    };
    test_bundle(bundle)?;
    Ok(Container {
        bundle: bundle.to_path_buf(),
        id: id.to_string(),
        seccomp: choice.profile(&security.capabilities)?,
        security,
        host_pins: Some(host_pins.to_path_buf()),
        binds,
    })
}

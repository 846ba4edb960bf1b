//! Reading one Service: is it ours, which LoadBalancer IPs, which mode.
use super::types::{Mode, PortRule, Protocol, ServiceRef, Uid};
use super::warning::{Warning, WarningKind, Warnings};
use super::Cidr;
use k8s_openapi::api::core::v1::Service;
use std::{collections::BTreeSet, net::IpAddr, sync::Arc};

pub const PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
pub const PROXY_NAME: &str = "cozy-proxy";
pub const WHOLE_IP_ANNOTATION: &str = "networking.cozystack.io/wholeIP";
pub const ALLOW_ICMP_ANNOTATION: &str = "networking.cozystack.io/allowICMP";

/// Ports one Service's port filter may list: one Service (a tenant) must
/// not fill the node's port table for everyone (the eBPF map holds
/// 262 144 over all pods). Beyond it, the ports after the first this many
/// in `spec.ports` are not allowed (fail closed) and the Service is warned.
pub const MAX_PORTS_PER_SERVICE: usize = 4096;
/// `loadBalancerSourceRanges` entries one Service may list, for the same
/// reason (65 536 prefixes over all LB IPs); the ranges after these are
/// not allowed.
pub const MAX_SOURCE_RANGES_PER_SERVICE: usize = 1024;

/// What a managed Service asks for, before endpoints and conflicts.
#[derive(Clone, Debug)]
pub struct ServiceIntent {
    pub service: ServiceRef,
    /// `metadata.creationTimestamp`, to order Services in conflicts (older
    /// wins). `None` (manifests without it) sorts first.
    pub created: Option<k8s_openapi::jiff::Timestamp>,
    /// Valid LoadBalancer IPs, in status order, without repeats.
    pub lb_ips: Box<[IpAddr]>,
    /// Shared with every mapping of the Service (a port filter's set is
    /// not copied into each).
    pub mode: Arc<Mode>,
    /// `spec.loadBalancerSourceRanges` (both families); `None`: unrestricted;
    /// an empty set after an invalid entry: nothing passes.
    pub source_ranges: Option<BTreeSet<Cidr>>,
}

/// A selected Service as the model reads it, kept by the Kubernetes
/// source instead of the object (a fraction of its size): what it asks
/// for, the problems found in it, and its uid (Events name it).
#[derive(Clone, Debug)]
pub struct ReadService {
    pub intent: ServiceIntent,
    pub warnings: Vec<Warning>,
    pub uid: Option<Uid>,
    /// `spec.selector` names at least one label: the EndpointSlice
    /// controller writes its slices (a Service without one gets none).
    pub selects_pods: bool,
}

/// Reads a selected Service.
pub fn read_service(svc: &Service) -> ReadService {
    let service = service_ref(svc);
    let mut warnings = Vec::new();
    let intent = read_intent(
        svc,
        &mut Warnings {
            service: &service,
            out: &mut warnings,
        },
    );
    ReadService {
        intent,
        warnings,
        uid: svc.metadata.uid.as_deref().map(Uid::new),
        selects_pods: (svc.spec.as_ref())
            .and_then(|s| s.selector.as_ref())
            .is_some_and(|s| !s.is_empty()),
    }
}

/// Is this Service one cozy-proxy manages?
pub fn is_selected(svc: &Service) -> bool {
    let labelled = svc
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(PROXY_NAME_LABEL))
        .is_some_and(|v| v == PROXY_NAME);
    let annotated = svc
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(WHOLE_IP_ANNOTATION));
    labelled || annotated
}

pub fn service_ref(svc: &Service) -> ServiceRef {
    ServiceRef::new(
        svc.metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
        svc.metadata.name.clone().unwrap_or_default(),
    )
}

/// Reads a selected Service. Problems become warnings; the result is always
/// usable (fail closed where a value is invalid).
pub(crate) fn read_intent(svc: &Service, warnings: &mut Warnings<'_>) -> ServiceIntent {
    ServiceIntent {
        service: warnings.service.clone(),
        created: svc.metadata.creation_timestamp.as_ref().map(|t| t.0),
        lb_ips: load_balancer_ips(svc, warnings).into(),
        mode: shared(mode(svc, warnings)),
        source_ranges: source_ranges(svc, warnings),
    }
}

/// `spec.loadBalancerSourceRanges`. Any invalid entry fails the whole list
/// closed: a typo must not open the pod to everyone.
fn source_ranges(svc: &Service, warnings: &mut Warnings<'_>) -> Option<BTreeSet<Cidr>> {
    let listed = svc
        .spec
        .as_ref()
        .and_then(|s| s.load_balancer_source_ranges.as_ref())
        .filter(|l| !l.is_empty())?;
    let mut ranges = BTreeSet::new();
    let mut invalid = Vec::new();
    if listed.len() > MAX_SOURCE_RANGES_PER_SERVICE {
        warnings.push(
            WarningKind::TooManyEntries,
            format!(
                "spec.loadBalancerSourceRanges lists {} ranges; only the first {MAX_SOURCE_RANGES_PER_SERVICE} are allowed",
                listed.len()
            ),
        );
    }
    for text in listed.iter().take(MAX_SOURCE_RANGES_PER_SERVICE) {
        match text.parse::<Cidr>() {
            Ok(c) => {
                ranges.insert(c);
            }
            Err(e) => invalid.push(e),
        }
    }
    if !invalid.is_empty() {
        warnings.push(
            WarningKind::InvalidSourceRange,
            format!(
                "spec.loadBalancerSourceRanges: {}; failing closed: nothing reaches the pod through its LB IP",
                invalid.join("; ")
            ),
        );
        ranges.clear();
    }
    Some(ranges)
}

fn annotation<'a>(svc: &'a Service, key: &str) -> Option<&'a str> {
    svc.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// Parses a "true"/"false" annotation; anything else is reported and read as
/// `invalid_means`.
fn bool_annotation(
    svc: &Service,
    key: &str,
    absent_means: bool,
    invalid_means: bool,
    warnings: &mut Warnings<'_>,
) -> bool {
    match annotation(svc, key) {
        None => absent_means,
        Some("true") => true,
        Some("false") => false,
        Some(other) => {
            warnings.push(
                WarningKind::InvalidAnnotation,
                format!(
                    "annotation {key}={other:?} is neither \"true\" nor \"false\"; failing closed ({key}={invalid_means})"
                ),
            );
            invalid_means
        }
    }
}

/// `mode` to be shared by the Service's mappings; passthrough, the mode
/// of most Services, one copy for all.
fn shared(mode: Mode) -> Arc<Mode> {
    static PASSTHROUGH: std::sync::OnceLock<Arc<Mode>> = std::sync::OnceLock::new();
    match mode {
        Mode::Passthrough => PASSTHROUGH
            .get_or_init(|| Arc::new(Mode::Passthrough))
            .clone(),
        filter => Arc::new(filter),
    }
}

fn mode(svc: &Service, warnings: &mut Warnings<'_>) -> Mode {
    // An invalid wholeIP fails closed: port filter with the declared ports.
    let whole_ip = bool_annotation(svc, WHOLE_IP_ANNOTATION, true, false, warnings);
    if whole_ip {
        return Mode::Passthrough;
    }
    let allow_icmp = bool_annotation(svc, ALLOW_ICMP_ANNOTATION, false, false, warnings);
    Mode::PortFilter {
        ports: declared_ports(svc, warnings),
        allow_icmp,
    }
}

fn declared_ports(svc: &Service, warnings: &mut Warnings<'_>) -> BTreeSet<PortRule> {
    let mut ports = BTreeSet::new();
    let declared = svc.spec.as_ref().and_then(|s| s.ports.as_ref());
    for p in declared.into_iter().flatten() {
        let protocol = match p.protocol.as_deref().unwrap_or("TCP") {
            "TCP" => Protocol::Tcp,
            "UDP" => Protocol::Udp,
            "SCTP" => Protocol::Sctp,
            other => {
                warnings.push(
                    WarningKind::InvalidPort,
                    format!(
                        "port {} has unknown protocol {other:?}; not allowed",
                        p.port
                    ),
                );
                continue;
            }
        };
        match u16::try_from(p.port) {
            Ok(port) if port != 0 => {
                if ports.len() == MAX_PORTS_PER_SERVICE {
                    let listed = declared.map_or(0, Vec::len);
                    warnings.push(
                        WarningKind::TooManyEntries,
                        format!(
                            "spec.ports lists {listed} ports; only the first {MAX_PORTS_PER_SERVICE} are allowed"
                        ),
                    );
                    break;
                }
                ports.insert(PortRule { protocol, port });
            }
            _ => warnings.push(
                WarningKind::InvalidPort,
                format!("port {} is out of range; not allowed", p.port),
            ),
        }
    }
    ports
}

fn load_balancer_ips(svc: &Service, warnings: &mut Warnings<'_>) -> Vec<IpAddr> {
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    let mut ips = Vec::new();
    // Thousands of entries must not cost a quadratic search.
    let mut seen = std::collections::HashSet::new();
    let mut hostnames = Vec::new();
    for entry in ingress.into_iter().flatten() {
        match entry.ip.as_deref() {
            Some(text) => match text.parse::<IpAddr>() {
                Ok(ip) if seen.insert(ip) => ips.push(ip),
                Ok(_) => {}
                Err(_) => warnings.push(
                    WarningKind::InvalidIp,
                    format!("load-balancer IP {text:?} is not an IP address; skipped"),
                ),
            },
            None => {
                if let Some(h) = &entry.hostname {
                    hostnames.push(h.clone());
                }
            }
        }
    }
    if ips.is_empty() {
        if hostnames.is_empty() {
            warnings.push(
                WarningKind::NoLoadBalancerIp,
                "no load-balancer IP in status yet; nothing to map",
            );
        } else {
            warnings.push(
                WarningKind::HostnameOnly,
                format!(
                    "load-balancer status has only hostname(s) {}; a 1:1 NAT needs an IP; skipped",
                    hostnames.join(", ")
                ),
            );
        }
    }
    ips
}

//! Problems the model finds in its input, as values: the caller turns each
//! into a log line, a Kubernetes Event and a metric.
use super::types::ServiceRef;
use serde::Serialize;
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum WarningKind {
    /// `wholeIP` or `allowICMP` is neither "true" nor "false".
    InvalidAnnotation,
    /// An IP string in the Service status or an EndpointSlice does not parse.
    InvalidIp,
    /// The load-balancer status holds a hostname and no IP.
    HostnameOnly,
    /// The Service has no load-balancer IP yet.
    NoLoadBalancerIp,
    /// More than one LoadBalancer IP of one family: only the first is used.
    ExtraLoadBalancerIp,
    /// A port in `spec.ports` that the port filter cannot express.
    InvalidPort,
    /// No ready endpoint for a family that has a LoadBalancer IP.
    NoReadyEndpoint,
    /// Several distinct ready endpoint addresses: a 1:1 NAT needs exactly one.
    MultipleEndpoints,
    /// Another, older Service claims the same LoadBalancer IP.
    LoadBalancerIpConflict,
    /// Another, older Service claims the same pod IP.
    PodIpConflict,
    /// An LB or endpoint address that must never be translated: unspecified,
    /// loopback, multicast, link-local, or a node's own address.
    ForbiddenAddress,
    /// An EndpointSlice the Service's pod is not read from: not written by
    /// the EndpointSlice controller for it, in a namespace whose
    /// hand-written slices are not trusted (`model/trust.rs`).
    UntrustedEndpointSlice,
    /// A `loadBalancerSourceRanges` entry that is not an IP prefix: the
    /// Service fails closed (nothing reaches the pod through its LB IP).
    InvalidSourceRange,
    /// More ports or source ranges than one Service may list: those
    /// beyond the cap are not allowed.
    TooManyEntries,
    /// The node's datapath tables are full: the LB IP is not translated
    /// on this node (reported by the node, not found in the Service).
    DatapathFull,
    /// The Service's namespace holds its share of the node's datapath
    /// tables (`--namespace-share`): the LB IP is not translated on this
    /// node (reported by the node).
    NamespaceShare,
}

impl WarningKind {
    /// Found by one node about its own datapath, not by every node in the
    /// Service: only that node knows it, so it publishes the Event itself.
    pub fn is_node_local(self) -> bool {
        matches!(
            self,
            WarningKind::DatapathFull | WarningKind::NamespaceShare
        )
    }

    /// Stable name, used as Event reason and metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            WarningKind::InvalidAnnotation => "InvalidAnnotation",
            WarningKind::InvalidIp => "InvalidIP",
            WarningKind::HostnameOnly => "HostnameOnly",
            WarningKind::NoLoadBalancerIp => "NoLoadBalancerIP",
            WarningKind::ExtraLoadBalancerIp => "ExtraLoadBalancerIP",
            WarningKind::InvalidPort => "InvalidPort",
            WarningKind::NoReadyEndpoint => "NoReadyEndpoint",
            WarningKind::MultipleEndpoints => "MultipleEndpoints",
            WarningKind::LoadBalancerIpConflict => "LoadBalancerIPConflict",
            WarningKind::PodIpConflict => "PodIPConflict",
            WarningKind::ForbiddenAddress => "ForbiddenAddress",
            WarningKind::UntrustedEndpointSlice => "UntrustedEndpointSlice",
            WarningKind::InvalidSourceRange => "InvalidSourceRange",
            WarningKind::TooManyEntries => "TooManyEntries",
            WarningKind::DatapathFull => "DatapathFull",
            WarningKind::NamespaceShare => "NamespaceShare",
        }
    }
}

/// The first `at_most` of `items`, then "and N more", joined by commas: a
/// warning names what its input holds without growing with it.
pub(crate) fn first_few<T: fmt::Display>(
    items: impl IntoIterator<Item = T>,
    at_most: usize,
) -> String {
    let mut shown = Vec::new();
    let mut more = 0;
    for item in items {
        if shown.len() < at_most {
            shown.push(item.to_string());
        } else {
            more += 1;
        }
    }
    if more > 0 {
        shown.push(format!("and {more} more"));
    }
    shown.join(", ")
}

impl fmt::Display for WarningKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Warning {
    pub service: ServiceRef,
    pub kind: WarningKind,
    pub message: String,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.service, self.kind, self.message)
    }
}

/// Collects the warnings found while reading one Service.
#[derive(Debug)]
pub(crate) struct Warnings<'a> {
    pub service: &'a ServiceRef,
    pub out: &'a mut Vec<Warning>,
}

/// Warnings of one kind listed for one Service: a Service with thousands
/// of bad entries must not become thousands of Events.
pub const MAX_WARNINGS_PER_KIND: usize = 8;

impl Warnings<'_> {
    /// Adds a warning, unless the Service has [`MAX_WARNINGS_PER_KIND`] of
    /// its kind already: then one more says that the rest are not listed.
    /// (`out` stays short, so counting it is cheap.)
    pub fn push(&mut self, kind: WarningKind, message: impl Into<String>) {
        let listed = self.out.iter().filter(|w| w.kind == kind).count();
        let message = match listed {
            n if n < MAX_WARNINGS_PER_KIND => message.into(),
            n if n == MAX_WARNINGS_PER_KIND => {
                format!("more {kind} problems in this Service are not listed")
            }
            _ => return,
        };
        self.out.push(Warning {
            service: self.service.clone(),
            kind,
            message,
        });
    }
}

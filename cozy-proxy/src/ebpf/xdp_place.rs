//! Where the XDP program goes (`--xdp`), decided from what the kernel says
//! of each uplink: pure, tested without a kernel. `xdp.rs` does what this
//! decides.
use crate::netlink::netdev::act;
use crate::netlink::route::{XdpAttached, XDP_ATTACHED_DRV, XDP_ATTACHED_SKB};
use serde::Serialize;

/// `--xdp`: whether the XDP program goes on the node's uplinks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum XdpChoice {
    /// Not at all (the default: the TC programs serve every interface,
    /// as before the XDP program existed).
    #[default]
    Off,
    /// On every uplink: native where the driver runs XDP, generic
    /// (on the skb, in the stack) elsewhere.
    On,
    /// Native, on uplinks whose driver this project's suite runs it on
    /// ([`PROVEN_DRIVERS`]); nowhere else.
    Auto,
}

/// Drivers on which the tests run the XDP program natively, through every
/// scenario: where `auto` attaches it. A driver not run may reset its link
/// when a program is first attached, or strip VLAN tags before XDP
/// (docs/ebpf-datapath.md, "The XDP path").
pub const PROVEN_DRIVERS: &[&str] = &["veth"];

/// How the XDP program runs on an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum XdpMode {
    /// In the driver, before an skb exists.
    Native,
    /// In the stack, on the skb (`XDP_FLAGS_SKB_MODE`).
    Generic,
}

impl XdpMode {
    /// The mode IFLA_XDP reports it in, as `XdpAttached::mode`.
    pub fn attached(self) -> u8 {
        match self {
            XdpMode::Native => XDP_ATTACHED_DRV,
            XdpMode::Generic => XDP_ATTACHED_SKB,
        }
    }
}

/// What becomes of one uplink.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum Placement {
    /// The program goes (or stays) there in this mode.
    Attach { mode: XdpMode },
    /// Another XDP program is there: an interface runs one program per
    /// mode, and ours does not take its place (or chain it: no dispatcher
    /// is run). The TC programs serve it, as without XDP.
    Held { program_id: u32 },
    /// Not attached, for the reason given; the TC programs serve it.
    Skipped { why: &'static str },
}

/// What is known of an uplink when deciding.
#[derive(Clone, Debug, Default)]
pub struct Uplink<'a> {
    /// Its driver (a virtual device's kind, a physical one's driver name).
    pub driver: &'a str,
    /// `NETDEV_XDP_ACT_*` as the kernel reports them (`None`: not known).
    pub features: Option<u64>,
    /// The XDP program IFLA_XDP shows on it.
    pub attached: Option<XdpAttached>,
    /// Is that program ours (the one our pinned link holds)?
    pub ours: bool,
}

pub fn decide(choice: XdpChoice, u: &Uplink<'_>) -> Placement {
    if choice == XdpChoice::Off {
        return Placement::Skipped { why: "--xdp off" };
    }
    if let Some(a) = u.attached.filter(|_| !u.ours) {
        return Placement::Held {
            program_id: a.prog_id,
        };
    }
    let native = u.features.is_some_and(|f| f & act::BASIC != 0);
    match choice {
        XdpChoice::Auto if !PROVEN_DRIVERS.contains(&u.driver) => Placement::Skipped {
            why: "driver not among those the XDP path was run on (--xdp on attaches it)",
        },
        XdpChoice::Auto if !native => Placement::Skipped {
            why: "driver without native XDP (--xdp on runs it generic)",
        },
        _ => Placement::Attach {
            mode: if native {
                XdpMode::Native
            } else {
                XdpMode::Generic
            },
        },
    }
}

/// Do frames redirected from XDP reach an interface with these features?
pub fn takes_frames(features: u64) -> bool {
    features & act::NDO_XMIT != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn veth(features: u64) -> Uplink<'static> {
        Uplink {
            driver: "veth",
            features: Some(features),
            ..Default::default()
        }
    }

    #[test]
    fn auto_attaches_natively_on_proven_drivers_only() {
        let native = Placement::Attach {
            mode: XdpMode::Native,
        };
        assert_eq!(decide(XdpChoice::Auto, &veth(act::BASIC)), native);
        let ixgbe = Uplink {
            driver: "ixgbe",
            features: Some(act::BASIC | act::REDIRECT),
            ..Default::default()
        };
        assert!(matches!(
            decide(XdpChoice::Auto, &ixgbe),
            Placement::Skipped { .. }
        ));
        assert_eq!(decide(XdpChoice::On, &ixgbe), native);
        // A veth without native XDP (no peer yet): not in auto.
        assert!(matches!(
            decide(XdpChoice::Auto, &veth(0)),
            Placement::Skipped { .. }
        ));
    }

    #[test]
    fn on_runs_generic_where_the_driver_has_no_native_xdp() {
        let u = Uplink {
            driver: "bond",
            features: Some(0),
            ..Default::default()
        };
        assert_eq!(
            decide(XdpChoice::On, &u),
            Placement::Attach {
                mode: XdpMode::Generic
            }
        );
        let unknown = Uplink::default();
        assert_eq!(
            decide(XdpChoice::On, &unknown),
            Placement::Attach {
                mode: XdpMode::Generic
            }
        );
    }

    #[test]
    fn another_agents_program_holds_the_interface() {
        let theirs = Uplink {
            attached: Some(XdpAttached {
                mode: XDP_ATTACHED_DRV,
                prog_id: 42,
            }),
            ..veth(act::BASIC)
        };
        for choice in [XdpChoice::On, XdpChoice::Auto] {
            assert_eq!(decide(choice, &theirs), Placement::Held { program_id: 42 });
        }
        let ours = Uplink {
            ours: true,
            ..theirs
        };
        assert!(matches!(
            decide(XdpChoice::Auto, &ours),
            Placement::Attach { .. }
        ));
        assert!(matches!(
            decide(XdpChoice::Off, &ours),
            Placement::Skipped { .. }
        ));
    }

    #[test]
    fn only_interfaces_that_take_xdp_frames_are_targets() {
        assert!(takes_frames(act::BASIC | act::NDO_XMIT));
        assert!(!takes_frames(act::BASIC | act::REDIRECT));
    }
}

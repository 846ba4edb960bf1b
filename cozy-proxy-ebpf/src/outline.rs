//! What keeps the verifier's work small: the verifier walks every path of
//! a program with what it knows of each register and stack slot, and
//! prunes a path only where its state matches one already checked.
//!
//! - The parse writes the packet into a per-CPU map value (`scratch`),
//!   not onto the stack. Read back from there, its fields are unknowns to
//!   the verifier: the paths after the parse merge, instead of each
//!   header layout (family, VLAN tag, options, extension headers) carrying
//!   its own offsets and flags through the rest of the program. With the
//!   packet on the stack the two TC programs took 750 000 processed
//!   instructions to load, 0.6 s of CPU at every start; from the map,
//!   about 40 000 (docs/notes/2026-12-xdp-and-the-verifier.md).
//! - The port filter's check of an ICMP error against the pod's flows is a
//!   global BPF function, called by the caller of the filter rather than
//!   from inside it: a global function is verified once, and the two
//!   checks' frames are never on the stack together (a call chain holds
//!   512 bytes of stack in all).
//!
//! Reading packet offsets that the verifier does not know as constants is
//! what `frame::packet_offset` and `parse::byte` are shaped for.
use crate::filter::{self, Admission};
use crate::frame::Frame;
use crate::maps::SCRATCH;
use crate::parse::{parse, Packet};
use crate::stats;
use aya_ebpf::{
    bindings::{__sk_buff, xdp_md},
    programs::{TcContext, XdpContext},
};
use cozy_proxy_common::DropReason;

/// The parse and the filter as the programs call them.
pub trait OutOfLine: Frame {
    /// The packet's headers, in this CPU's `scratch` slot; `None` for
    /// anything but IPv4 and IPv6.
    fn parsed(&self) -> Option<&'static mut Packet>;
    /// [`filter::admit`] for `p` toward a filtered pod (`p.dst`), a drop
    /// counted under its reason: `false` drops it.
    fn admitted(&self, p: &Packet, allow_icmp: bool, slot: u16, routed: bool) -> bool;
}

/// This CPU's packet (`scratch`).
#[inline(always)]
fn scratch() -> Option<&'static mut Packet> {
    // SAFETY: a per-CPU map value; a program runs to its end on its CPU
    // (in a softirq, or with bottom halves off) before another takes it.
    SCRATCH.get_ptr_mut(0).map(|p| unsafe { &mut *p })
}

/// Makes the compiler read memory again after this point (an `asm!` that
/// may write any memory: a register moved to itself). Without it, LLVM
/// hands the parse's results on in registers, and the verifier sees them
/// as exactly as before.
#[inline(always)]
fn forget_values() {
    // SAFETY: touches no memory; the compiler must assume it does.
    unsafe { core::arch::asm!("{0} = {0}", inout(reg) 0usize => _, options(nostack)) };
}

#[inline(always)]
fn parse_into_scratch<C: Frame>(ctx: &C) -> Option<&'static mut Packet> {
    let p = scratch()?;
    if !parse(ctx, p) {
        return None;
    }
    forget_values();
    p.in_bounds().then_some(p)
}

/// A drop counted: `false`.
#[inline(always)]
fn admitted_or_counted<C: Frame>(ctx: &C, verdict: Result<(), DropReason>) -> bool {
    match verdict {
        Ok(()) => true,
        Err(reason) => {
            stats::dropped(ctx, reason);
            false
        }
    }
}

/// The filter's decision, the check of an ICMP error by `about_pods_flow`
/// (the global function of the context type).
#[inline(always)]
fn admit_at<C: Frame>(
    ctx: &C,
    p: &Packet,
    (allow_icmp, slot, routed): (bool, u16, bool),
    about_pods_flow: impl FnOnce() -> bool,
) -> bool {
    match filter::admit(ctx, p, allow_icmp, slot, routed) {
        Ok(Admission::Admitted) => true,
        Ok(Admission::IfAboutPodsFlow) => about_pods_flow(),
        Err(reason) => admitted_or_counted(ctx, Err(reason)),
    }
}

/// The body of the global `admit_error` functions: `p` may be null, and its
/// offsets are checked again (a global function cannot know its caller's).
#[inline(always)]
fn admit_error_at<C: Frame>(ctx: &C, p: *const Packet, slot: u32) -> i32 {
    // SAFETY: the caller's packet, checked non-null.
    let Some(p) = (unsafe { p.as_ref() }).filter(|p| p.in_bounds()) else { return 0 };
    admitted_or_counted(ctx, filter::admit_error(ctx, p, slot as u16)) as i32
}

/// The global function of one context type, and its [`OutOfLine`].
macro_rules! out_of_line {
    ($ctx:ty, $raw:ty, $admit_error:ident) => {
        #[no_mangle]
        #[inline(never)]
        pub extern "C" fn $admit_error(raw: *mut $raw, p: *const Packet, slot: u32) -> i32 {
            admit_error_at(&<$ctx>::new(raw), p, slot)
        }

        impl OutOfLine for $ctx {
            #[inline(always)]
            fn parsed(&self) -> Option<&'static mut Packet> {
                parse_into_scratch(self)
            }

            #[inline(always)]
            fn admitted(&self, p: &Packet, allow_icmp: bool, slot: u16, routed: bool) -> bool {
                admit_at(self, p, (allow_icmp, slot, routed), || {
                    $admit_error(self.raw() as *mut $raw, p, slot as u32) != 0
                })
            }
        }
    };
}

out_of_line!(TcContext, __sk_buff, cozy_admit_error_tc);
out_of_line!(XdpContext, xdp_md, cozy_admit_error_xdp);

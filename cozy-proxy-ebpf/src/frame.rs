//! What the programs read and write a packet through: the skb of a TC
//! program or the frame of an XDP program. Parsing, the port filter and
//! the rewrite are written once against [`Frame`]; the two differ only in
//! what the kernel offers each (an skb can be made linear and keeps its
//! checksum state, which its helper follows; an XDP frame is the bytes a
//! driver received, whose checksums are complete).
use aya_ebpf::{
    bindings::BPF_F_MARK_MANGLED_0,
    helpers::generated::{bpf_xdp_get_buff_len, bpf_xdp_load_bytes},
    programs::{TcContext, XdpContext},
    EbpfContext,
};
use crate::csum::{halves, halves_neg, replace};
use core::{ffi::c_void, mem::MaybeUninit};

/// The flags' field size bits, as `bpf_l4_csum_replace` reads them.
const HDR_FIELD_MASK: u64 = 0xf;

pub trait Frame {
    /// The first byte of the linear data.
    fn data(&self) -> usize;
    /// One past the last byte of the linear data.
    fn data_end(&self) -> usize;
    /// The packet's whole length, linear data and pages.
    fn len(&self) -> u32;
    /// `size_of::<T>()` bytes at `off`, wherever they lie (copied by the
    /// kernel); `None` past the packet's end.
    fn copy<T: Copy>(&self, off: usize) -> Option<T>;
    /// Makes the first `len` bytes linear where the frame can be (an skb);
    /// best effort.
    fn pull(&self, len: u32);
    /// Fixes the checksum at `off` for a change from `from` to `to`, with
    /// `bpf_l4_csum_replace`'s flags: the field's size (2 or 4, or 0 with
    /// `to` a difference already summed), `BPF_F_PSEUDO_HDR`,
    /// `BPF_F_MARK_MANGLED_0` (a zero UDP checksum stays zero, and a
    /// computed zero is written as 0xffff).
    fn l4_csum_replace(&mut self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), i64>;
    /// The context as the helpers take it (`bpf_fib_lookup`).
    fn raw(&self) -> *mut c_void;
    /// The interface the packet is at: a TC hook's device (its arrival
    /// at ingress, its way out at egress), an XDP frame's receiver.
    fn ifindex(&self) -> u32;
    /// Does the packet carry a VLAN tag outside its bytes (an skb's
    /// metadata)? An XDP frame's tag, where a driver strips it, is not
    /// readable here (see docs/ebpf-datapath.md, the XDP path).
    fn vlan_offloaded(&self) -> bool;
}

impl Frame for TcContext {
    #[inline(always)]
    fn data(&self) -> usize {
        TcContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        TcContext::data_end(self)
    }

    #[inline(always)]
    fn len(&self) -> u32 {
        TcContext::len(self)
    }

    #[inline(always)]
    fn copy<T: Copy>(&self, off: usize) -> Option<T> {
        self.load::<T>(off).ok()
    }

    #[inline(always)]
    fn pull(&self, len: u32) {
        let _ = self.pull_data(len);
    }

    /// The kernel's helper: the program cannot see whether the skb's
    /// checksum is partial, complete or absent, and the helper keeps each
    /// right (`skb->csum` too).
    #[inline(always)]
    fn l4_csum_replace(&mut self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), i64> {
        TcContext::l4_csum_replace(self, off, from, to, flags)
    }

    #[inline(always)]
    fn raw(&self) -> *mut c_void {
        self.as_ptr()
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        // SAFETY: reading a field of the context the kernel passed us.
        unsafe { (*self.skb.skb).ifindex }
    }

    #[inline(always)]
    fn vlan_offloaded(&self) -> bool {
        // SAFETY: as above.
        unsafe { (*self.skb.skb).vlan_present != 0 }
    }
}

impl Frame for XdpContext {
    #[inline(always)]
    fn data(&self) -> usize {
        XdpContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        XdpContext::data_end(self)
    }

    #[inline(always)]
    fn len(&self) -> u32 {
        // SAFETY: the context the kernel passed us.
        unsafe { bpf_xdp_get_buff_len(self.ctx as *mut _) as u32 }
    }

    #[inline(always)]
    fn copy<T: Copy>(&self, off: usize) -> Option<T> {
        let mut v = MaybeUninit::<T>::uninit();
        // SAFETY: the helper writes `size_of::<T>()` bytes or fails.
        let rc = unsafe {
            bpf_xdp_load_bytes(
                self.ctx as *mut _,
                off as u32,
                v.as_mut_ptr() as *mut c_void,
                core::mem::size_of::<T>() as u32,
            )
        };
        // SAFETY: filled by the helper when it succeeded.
        (rc == 0).then(|| unsafe { v.assume_init() })
    }

    /// A frame's first buffer holds its headers: nothing to pull.
    #[inline(always)]
    fn pull(&self, _len: u32) {}

    /// RFC 1624's incremental update, as `bpf_l4_csum_replace` does for
    /// an skb whose checksum is not partial: a received frame's checksums
    /// are complete (no helper exists for XDP).
    #[inline(always)]
    fn l4_csum_replace(&mut self, off: usize, from: u64, to: u64, flags: u64) -> Result<(), i64> {
        let at = self.data() + packet_offset(off);
        if at + 2 > self.data_end() {
            return Err(-1);
        }
        // SAFETY: bounds checked just above; alignment as in
        // parse::load_words (a plain load, which the CPU allows unaligned).
        let csum = unsafe { core::ptr::read(at as *const u16) };
        let mangled_0 = flags & BPF_F_MARK_MANGLED_0 as u64 != 0;
        if mangled_0 && csum == 0 {
            return Ok(());
        }
        let delta = match flags & HDR_FIELD_MASK {
            0 => halves(to as u32),
            2 => (!(from as u16)) as u32 + (to as u16) as u32,
            4 => halves_neg(from as u32) + halves(to as u32),
            _ => return Err(-1),
        };
        let mut out = replace(csum, delta);
        if mangled_0 && out == 0 {
            out = 0xffff;
        }
        // SAFETY: as above.
        unsafe { core::ptr::write(at as *mut u16, out) };
        Ok(())
    }

    #[inline(always)]
    fn raw(&self) -> *mut c_void {
        self.as_ptr()
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        // SAFETY: reading a field of the context the kernel passed us.
        unsafe { (*self.ctx).ingress_ifindex }
    }

    #[inline(always)]
    fn vlan_offloaded(&self) -> bool {
        false
    }
}

/// `off` as the verifier can bound it before it is added to a packet
/// pointer: the same value for every offset into a packet's headers
/// (below `parse::MAX_L4` and what follows it), in two instructions. In the
/// global functions (outline.rs) an offset read from the caller's packet
/// is otherwise unknown, and the verifier refuses the addition; bounded
/// this far below `MAX_PACKET_OFF` (0xffff), a bounds check on it still
/// tells the verifier the range it proves.
///
/// Opaque to LLVM (a register move in `asm!`, which it must assume may
/// change the value; an empty template would leave a line of debug info
/// on no instruction, which the kernel refuses): it would otherwise
/// drop a bounds check another check implies for its own arithmetic, which
/// the verifier cannot follow when the offsets are not constants.
#[inline(always)]
pub fn packet_offset(off: usize) -> usize {
    let mut off = off;
    // SAFETY: a move of the register to itself; it only hides the value
    // from the compiler.
    unsafe { core::arch::asm!("{0} = {0}", inout(reg) off, options(pure, nomem, nostack)) };
    off & 0x7fff
}

//! cozy-proxy TC programs.
//!
//! For now one program that lets every packet continue: it proves the
//! toolchain, the embedding in the userspace binary and the load path.
#![no_std]
#![no_main]

use aya_ebpf::{bindings::TC_ACT_PIPE, macros::classifier, programs::TcContext};

#[classifier]
pub fn cozy_proxy_tc(_ctx: TcContext) -> i32 {
    TC_ACT_PIPE
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

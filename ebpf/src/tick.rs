//! The kernel's tick counter, read by the agent to learn the tick rate (`CONFIG_HZ`) of the
//! running kernel: the drop-event limiter refills its buckets from `jiffies`
//! (`ebpf/src/events.rs`), and the agent must know how long a jiffy is to give it the right
//! credit. Run twice under `BPF_PROG_TEST_RUN`, some time apart;
//! never attached to anything. Asking the kernel this way needs nothing the agent does not
//! already have (CAP_BPF), unlike `/proc/timer_list` (root, and masked in containers) or
//! `/proc/schedstat` (absent without `CONFIG_SCHEDSTATS`).
#![no_std]
#![no_main]

use aya_ebpf::{helpers::bpf_jiffies64, macros::classifier, programs::TcContext};

/// The low 32 bits of `jiffies`, as the run's return value.
#[classifier]
pub fn wgfence_tick(_ctx: TcContext) -> i32 {
    // SAFETY: a helper without arguments or side effects.
    let jiffies = unsafe { bpf_jiffies64() };
    jiffies as u32 as i32
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";

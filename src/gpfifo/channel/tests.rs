use super::{Channel, ChannelConfig, prefetch_for_write};
use crate::rm::GpuCore;
use crate::rm::sim::SimConfig;
use crate::rm::sys;

#[test]
fn graphics_channel_groups_are_preempted_at_instruction_level() {
    let (core, bus) = GpuCore::open_simulated(SimConfig::default()).unwrap();
    let shared = Channel::new(&core, ChannelConfig::default()).unwrap();
    let joined = Channel::new(&core, ChannelConfig::default()).unwrap();
    let own = Channel::new(
        &core,
        ChannelConfig {
            own_group: true,
            ..ChannelConfig::default()
        },
    )
    .unwrap();
    assert_eq!(shared.handles().0, joined.handles().0);
    // Set once per group founded, as libcuda sets it: RM's default (wait for idle) ends a long grid when
    // another process needs the engine.
    for c in [&shared, &own] {
        assert_eq!(
            bus.lock().compute_preemption(c.handles().0),
            Some(sys::NV2080_CTRL_SET_CTXSW_PREEMPTION_MODE_COMPUTE_CILP)
        );
    }
    // A copy-engine group has no graphics context to preempt: nothing is set for it.
    let lce = (0..crate::rm::MAX_LCES)
        .find(|&l| SimConfig::default().usable_copy_engines() & (1 << l) != 0)
        .unwrap();
    let copy = Channel::new(&core, ChannelConfig::copy_engine(lce)).unwrap();
    assert_eq!(bus.lock().compute_preemption(copy.handles().0), None);
}

#[test]
fn a_write_prefetch_never_faults_and_changes_nothing() {
    let words = [7u32; 64];
    prefetch_for_write(words.as_ptr().cast());
    assert!(words.iter().all(|&w| w == 7));
    // Addresses nothing is mapped at, and a non-canonical one: a hint, never an access.
    for addr in [
        0usize,
        8,
        0xdead_0000,
        usize::MAX - 63,
        0x8000_0000_0000_0000,
    ] {
        prefetch_for_write(addr as *const u8);
    }
}

//! Tests of the simulated RM: opening, access checks, copy-engine groups, refused objects and controls, the
//! performance boost.

use super::objects::{
    NV_ERR_INVALID_ARGUMENT, NV_ERR_INVALID_CLASS, NV_ERR_INVALID_STATE, NV_ERR_NOT_SUPPORTED,
};
use super::*;
use crate::rm::{
    COPY_ALLOC_VERSION_ENGINE_TYPE, COPY_ALLOC_VERSION_INSTANCE, ChannelGroupSchedule,
    CopyAllocParams, Memory, MemoryDesc, Placement, RmControl, copy_engine_type,
};

#[test]
fn opens_like_an_h200_and_checks_every_access() {
    let (core, bus) = GpuCore::open_simulated(SimConfig::default()).unwrap();
    let i = core.info();
    assert_eq!(
        (i.sm_version, i.sm_count, i.gpc_count, i.tpc_count),
        (90, 132, 8, 66)
    );
    assert_eq!((i.sms_per_tpc, i.max_warps_per_sm), (2, 64));
    assert_eq!(i.name, "APEX simulated Hopper");
    assert!(core.has_class(0xc86f) && core.has_class(0xcbc0) && core.has_class(0xc8b5));
    assert!(core.has_class(0xc661));
    assert!(!core.usermode_ptr().is_null());
    // The doorbell travels the way USERD's GP_PUT does (BAR1), so it cannot overtake it.
    assert_eq!(bus.lock().doorbell_through_bar1(), Some(true));

    let mem = Memory::alloc(
        &core,
        MemoryDesc::video(0x1000)
            .placement(Placement::SystemCached)
            .with_cpu()
            .low(),
    )
    .unwrap();
    assert_eq!(mem.cpu_ptr().map(|p| p.as_ptr() as u64), Some(mem.va()));
    mem.write_u64_volatile(8, 0x1234).unwrap();
    let va = mem.va();
    {
        let v = bus.lock();
        assert_eq!(v.read_u64(va + 8), Ok(0x1234));
        v.write_u32(va + 16, 7).unwrap();
        assert_eq!(
            v.read_u32(va + 0x1000),
            Err(AccessError::Unmapped {
                va: va + 0x1000,
                len: 4
            })
        );
        assert_eq!(
            v.read_u64(va + 4),
            Err(AccessError::Misaligned { va: va + 4, len: 8 })
        );
    }
    assert_eq!(mem.read_u32_volatile(16).unwrap(), 7);
    drop(mem);
    assert!(!bus.lock().contains(va, 4), "a freed buffer is unreachable");
}

/// The objects of a copy-only channel on LCE `group_lce`, built by hand; `copy` is the copy object's
/// allocation parameters (`None`: none, as APEX allocated it before it named the engine).
struct CopyChannel {
    _copy: Object,
    _channel: Arc<Object>,
    group: Arc<Object>,
    _mem: (Memory, Memory),
}

fn group_on(core: &Arc<GpuCore>, lce: u32) -> Arc<Object> {
    let mut gp = sys::NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS {
        engineType: copy_engine_type(lce).expect("an LCE RM names"),
        hVASpace: core.vaspace().handle(),
        ..Default::default()
    };
    Arc::new(
        Object::alloc(
            core.client(),
            Some(core.device()),
            sys::KEPLER_CHANNEL_GROUP_A,
            Some(&mut gp),
            "group",
        )
        .expect("copy-engine group"),
    )
}

fn channel_params(ring: &Memory, notifier: &Memory) -> sys::NV_CHANNEL_ALLOC_PARAMS {
    let mut cp = sys::NV_CHANNEL_ALLOC_PARAMS {
        hObjectError: notifier.handle(),
        hObjectBuffer: ring.handle(),
        gpFifoOffset: ring.va(),
        gpFifoEntries: 64,
        ..Default::default()
    };
    cp.hUserdMemory[0] = ring.handle();
    cp.userdOffset[0] = 0x1000;
    cp
}

fn copy_channel(
    core: &Arc<GpuCore>,
    group_lce: u32,
    copy: Option<CopyAllocParams>,
) -> Result<CopyChannel> {
    let desc = MemoryDesc::video(0x2000).with_cpu().low();
    let (ring, notifier) = (
        Memory::alloc(core, desc).unwrap(),
        Memory::alloc(core, desc).unwrap(),
    );
    let group = group_on(core, group_lce);
    let mut cp = sys::NV_CHANNEL_ALLOC_PARAMS {
        engineType: copy_engine_type(group_lce).unwrap(),
        ..channel_params(&ring, &notifier)
    };
    let channel = Arc::new(Object::alloc(
        core.client(),
        Some(&group),
        0xc86f,
        Some(&mut cp),
        "channel",
    )?);
    let copy = match copy {
        None => Object::alloc::<()>(core.client(), Some(&channel), 0xc8b5, None, "copy")?,
        Some(mut p) => Object::alloc(core.client(), Some(&channel), 0xc8b5, Some(&mut p), "copy")?,
    };
    Ok(CopyChannel {
        _copy: copy,
        _channel: channel,
        group,
        _mem: (ring, notifier),
    })
}

fn schedule(group: &Object) -> Result<()> {
    let mut p = ChannelGroupSchedule(sys::NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS {
        bEnable: 1,
        ..Default::default()
    });
    group.ctrl(&mut p)
}

fn by_engine(lce: u32) -> Option<CopyAllocParams> {
    Some(CopyAllocParams {
        version: COPY_ALLOC_VERSION_ENGINE_TYPE,
        engine_type: copy_engine_type(lce).unwrap(),
    })
}

#[test]
fn a_copy_group_schedules_only_when_its_copy_objects_run_on_its_engine() {
    let (core, _bus) = GpuCore::open_simulated(SimConfig::default()).unwrap();
    // The copy object as APEX allocated it before: no parameters, so RM binds it to CE 0 while the group
    // is on LCE 2.
    let old = copy_channel(&core, 2, None).expect("objects are accepted");
    let e = schedule(&old.group).expect_err("the group spans two runlists");
    assert_eq!(e.status(), Some(NV_ERR_INVALID_STATE));
    // Named by engine type (version 1, what the channel code passes now) or by CE instance (version 0).
    let v1 = copy_channel(&core, 2, by_engine(2)).unwrap();
    schedule(&v1.group).expect("copy object on the group's engine");
    let v0 = copy_channel(
        &core,
        3,
        Some(CopyAllocParams {
            version: COPY_ALLOC_VERSION_INSTANCE,
            engine_type: 3,
        }),
    )
    .unwrap();
    schedule(&v0.group).expect("CE instance 3 in a group on LCE 3");
    let other = copy_channel(&core, 2, by_engine(4)).unwrap();
    let e = schedule(&other.group).expect_err("copy object on LCE 4, group on LCE 2");
    assert_eq!(e.status(), Some(NV_ERR_INVALID_STATE));
    // LCEs 0 and 1 share the graphics runlist: a copy-only group there is refused even when consistent.
    let grce = copy_channel(&core, 0, by_engine(0)).unwrap();
    let e = schedule(&grce.group).expect_err("a graphics-runlist CE");
    assert_eq!(e.status(), Some(NV_ERR_INVALID_STATE));
}

#[test]
fn absent_engines_subcontexts_in_copy_groups_and_channel_va_spaces_are_refused() {
    let (core, _bus) = GpuCore::open_simulated(SimConfig::default()).unwrap();
    let status = |r: Result<CopyChannel>| r.map(drop).unwrap_err().status();
    // LCE 7 is not on the simulated GPU; version 2 is not a version RM knows.
    assert_eq!(
        status(copy_channel(&core, 7, by_engine(7))),
        Some(NV_ERR_INVALID_ARGUMENT)
    );
    let bad_version = Some(CopyAllocParams {
        version: 2,
        engine_type: 2,
    });
    assert_eq!(
        status(copy_channel(&core, 2, bad_version)),
        Some(NV_ERR_INVALID_ARGUMENT)
    );
    // Subcontexts are graphics-only.
    let group = group_on(&core, 2);
    let mut cs = sys::NV_CTXSHARE_ALLOCATION_PARAMETERS {
        hVASpace: core.vaspace().handle(),
        flags: sys::NV_CTXSHARE_ALLOCATION_FLAGS_SUBCONTEXT_ASYNC,
        subctxId: 0,
    };
    let e = Object::alloc(
        core.client(),
        Some(&group),
        sys::FERMI_CONTEXT_SHARE_A,
        Some(&mut cs),
        "ctxshare",
    )
    .unwrap_err();
    assert_eq!(e.status(), Some(NV_ERR_INVALID_ARGUMENT));
    // A channel in a group does not name a VA space of its own.
    let desc = MemoryDesc::video(0x2000).with_cpu().low();
    let (ring, notifier) = (
        Memory::alloc(&core, desc).unwrap(),
        Memory::alloc(&core, desc).unwrap(),
    );
    let mut cp = sys::NV_CHANNEL_ALLOC_PARAMS {
        hVASpace: core.vaspace().handle(),
        ..channel_params(&ring, &notifier)
    };
    let e = Object::alloc(
        core.client(),
        Some(&group),
        0xc86f,
        Some(&mut cp),
        "channel",
    )
    .unwrap_err();
    assert_eq!(e.status(), Some(NV_ERR_INVALID_ARGUMENT));
    cp.hVASpace = 0;
    Object::alloc(
        core.client(),
        Some(&group),
        0xc86f,
        Some(&mut cp),
        "channel",
    )
    .expect("the same channel without its own VA space");
}

#[test]
fn unknown_controls_and_classes_are_refused() {
    let (core, _bus) = GpuCore::open_simulated(SimConfig::default()).unwrap();
    /// A command RM does not know, with GET_GPC_MASK's parameters.
    #[repr(transparent)]
    struct Bogus(sys::NV2080_CTRL_GR_GET_GPC_MASK_PARAMS);
    // SAFETY: the struct is GET_GPC_MASK's parameters; the command is refused before they are read.
    unsafe impl RmControl for Bogus {
        const CMD: u32 = 0x2080_ffff;
        const NAME: &'static str = "bogus";
    }
    let mut p = Bogus(Default::default());
    let e = core.subdevice().ctrl(&mut p).unwrap_err();
    assert_eq!(e.status(), Some(NV_ERR_NOT_SUPPORTED));
    let e = Object::alloc::<()>(core.client(), Some(core.device()), 0xc56f, None, "ampere")
        .unwrap_err();
    assert_eq!(e.status(), Some(NV_ERR_INVALID_CLASS));
}

#[test]
fn opening_asks_for_cudas_boost_and_rm_checks_it() {
    let (core, bus) = GpuCore::open_simulated(SimConfig::default()).unwrap();
    // Unless APEX_PERF_BOOST=0 is set in the environment of the test run.
    let wanted = super::super::gpu::perf_boost_wanted(
        std::env::var_os(super::super::gpu::PERF_BOOST_ENV).as_deref(),
    );
    assert_eq!(
        bus.lock().perf_boost(),
        wanted.then_some((0x12, sys::NV2080_CTRL_PERF_BOOST_DURATION_INFINITE))
    );
    let mut bad = sys::NV2080_CTRL_PERF_BOOST_PARAMS {
        flags: 0x3,
        duration: 10,
    };
    let e = core.subdevice().ctrl(&mut bad).unwrap_err();
    assert_eq!(e.status(), Some(NV_ERR_INVALID_ARGUMENT));
    let mut clear = sys::NV2080_CTRL_PERF_BOOST_PARAMS {
        flags: 0,
        duration: 0,
    };
    core.subdevice().ctrl(&mut clear).unwrap();
    assert_eq!(bus.lock().perf_boost(), Some((0, 0)));
}

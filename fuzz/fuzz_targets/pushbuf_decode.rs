//! The pushbuffer decoder on arbitrary words (little-endian u32s of the input; a trailing partial word is
//! dropped) with the Hopper subchannel bindings, every decoded method formatted, and `decode_qmd` on the
//! same bytes for layouts 3, 4 and 5 (and for the version byte the input starts with).
//!
//! Seeds: with `APEX_FUZZ_SEED_DIR` set, the target writes pushbuffers encoded by `apex::pushbuf::Push` and
//! QMDs built by `apex::launch::qmd::build` into that directory before fuzzing starts (`fuzz/run.sh` points it
//! at the corpus directory), so the seeds always follow the encoders; nothing generated is committed.
#![no_main]

use apex::pushbuf::decode::{SubchannelClasses, decode, decode_qmd, decode_tracking};
use libfuzzer_sys::fuzz_target;

fuzz_target!(
    init: {
        if let Some(dir) = std::env::var_os("APEX_FUZZ_SEED_DIR").filter(|d| !d.is_empty()) {
            seeds::write(std::path::Path::new(&dir)).expect("writing pushbuffer seeds");
        }
    },
    |data: &[u8]| {
        let words: Vec<u32> = data
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let hopper = SubchannelClasses::hopper();
        match decode(&words, &hopper) {
            Ok(methods) => {
                for m in &methods {
                    let _ = m.to_string();
                }
            }
            Err(e) => {
                let _ = e.to_string();
            }
        }
        // Tracking bindings across two halves, as a tracer decoding consecutive segments does.
        let mut classes = hopper.clone();
        let (a, b) = words.split_at(words.len() / 2);
        if decode_tracking(a, &mut classes).is_ok() {
            let _ = decode_tracking(b, &mut classes);
        }
        let versions = [3, 4, 5, data.first().copied().unwrap_or(0)];
        for v in versions {
            if let Ok(fields) = decode_qmd(v, data) {
                assert!(fields.iter().all(|&(_, value)| value != 0));
            }
        }
    }
);

mod seeds {
    use std::io;
    use std::path::Path;

    use apex::launch::qmd::{self, ConstBuffer, QmdParams, QmdVersion};
    use apex::pushbuf::{Acquire, Header, Push, Release, Subchannel, header, immediate};

    fn bytes(words: &[u32]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    fn qmd_params() -> QmdParams {
        include!("../../tests/fixtures/qmd_b_add_params.rs")
    }

    pub fn write(dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut qmds = Vec::new();
        for v in [QmdVersion::V03, QmdVersion::V04, QmdVersion::V05] {
            let mut q = [0u32; qmd::QMD_WORDS];
            qmd::build(v, &qmd_params(), &mut q).expect("seed QMD builds");
            let words = &q[..v.size_bytes() / 4];
            std::fs::write(
                dir.join(format!("seed-qmd-v{:02}", v.major())),
                bytes(words),
            )?;
            qmds.push(q);
        }

        // A channel setup and a launch, the way the compute queue writes them.
        let mut buf = vec![0u32; 4096];
        let mut p = Push::new(&mut buf);
        p.set_object(Subchannel::COMPUTE, 0xcbc0);
        p.set_object(Subchannel::COPY, 0xc8b5);
        p.set_shader_windows(0x7fef_0000_0000, 0x7ff0_0000_0000);
        p.set_local_memory(0x2_0000_0000, 0x64_0000, 132);
        p.set_qmd_version(4, 4);
        p.set_spa_version(9, 0);
        p.invalidate_shader_caches_no_wfi();
        p.inline_upload(0x2_04e1_0000, &qmds[1][..QmdVersion::V04.size_bytes() / 4]);
        p.send_pcas(0x2_04e1_0000);
        p.sem_release(0x2_0460_fff0, 0x40, Release::AFTER_IDLE_64);
        let launch = p.words().to_vec();
        std::fs::write(dir.join("seed-push-launch"), bytes(&launch))?;

        // Host methods and every header kind.
        let mut buf = vec![0u32; 4096];
        let mut p = Push::new(&mut buf);
        p.sem_acquire(0x2_0460_fff0, 7, Acquire::CircularGeq, true, true);
        p.sem_acquire(0x2_0460_fff0, 7, Acquire::Equal, false, false);
        p.sem_acquire(0x2_0460_fff0, 7, Acquire::StrictGeq, true, false);
        p.sem_release(
            0x2_0460_fff0,
            8,
            Release {
                wfi: false,
                wide: false,
                timestamp: true,
            },
        );
        p.wfi();
        p.membar_sys();
        p.non_stall_interrupt();
        p.immediate(Subchannel::COMPUTE, 0x0100, 0x1abc);
        p.methods(
            Header::NonIncrementing,
            Subchannel::COMPUTE,
            0x0100,
            &[1, 2, 3],
        );
        p.methods(
            Header::IncrementOnce,
            Subchannel::COPY,
            0x0400,
            &[1, 2, 3, 4],
        );
        p.raw(&[0]); // NOP
        p.raw(&[
            header(Header::Incrementing, Subchannel(7), 0x0000, 1),
            0x0000_c8b5,
        ]);
        p.raw(&[immediate(Subchannel(2), 0x0040, 0)]);
        let host = p.words().to_vec();
        std::fs::write(dir.join("seed-push-host"), bytes(&host))?;

        let mut both = launch;
        both.extend_from_slice(&host);
        std::fs::write(dir.join("seed-push-both"), bytes(&both))?;
        Ok(())
    }
}

//! Device printf records (what the FIFO holds) and the device runtime object parser: arbitrary bytes must give a
//! record or a typed error, and formatting any decoded record must not panic or read past its arguments.
#![no_main]

use apex::module::printf::{DeviceRecord, DeviceRuntime, decode_record, format_printf};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(DeviceRecord::Printf { format, args }) = decode_record(data) {
        let _ = format_printf(&format, &args);
    }
    // A record body used directly as a format string, with no arguments: missing ones print as zero.
    let _ = format_printf(data, &[]);
    let _ = DeviceRuntime::parse(data);
});

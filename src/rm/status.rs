use std::fmt;

use super::sys::defs::STATUS_CODES;

/// An `NV_STATUS` returned by RM or UVM, printed with its name from `nvstatuscodes.h`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct NvStatus(pub u32);

impl NvStatus {
    /// `NV_OK`: the call succeeded.
    pub const OK: NvStatus = NvStatus(0);

    /// The symbolic name, e.g. `NV_ERR_INVALID_ARGUMENT`.
    pub fn name(self) -> Option<&'static str> {
        STATUS_CODES
            .iter()
            .find(|(code, _, _)| *code == self.0)
            .map(|(_, name, _)| *name)
    }

    /// NVIDIA's one-line description of the status.
    pub fn message(self) -> Option<&'static str> {
        STATUS_CODES
            .iter()
            .find(|(code, _, _)| *code == self.0)
            .map(|(_, _, msg)| *msg)
    }

    /// Whether this is `NV_OK`.
    pub fn is_ok(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for NvStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.name(), self.message()) {
            (Some(name), Some(msg)) => write!(f, "{name} ({:#x}: {msg})", self.0),
            _ => write!(f, "NV_STATUS {:#x}", self.0),
        }
    }
}

impl fmt::Debug for NvStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_from_the_header() {
        assert_eq!(NvStatus(0).name(), Some("NV_OK"));
        assert_eq!(NvStatus(0x1f).name(), Some("NV_ERR_INVALID_ARGUMENT"));
        assert_eq!(NvStatus(0x51).name(), Some("NV_ERR_NO_MEMORY"));
        assert!(NvStatus(0x1f).to_string().contains("Invalid argument"));
        assert_eq!(NvStatus(0xdead_beef).to_string(), "NV_STATUS 0xdeadbeef");
    }
}

/// GPFIFO ring bookkeeping: `put` is the next entry the CPU writes, `get` the next the GPU fetches (last read
/// from USERD). One slot stays empty so that `put == get` always means empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingState {
    entries: u32,
    put: u32,
    get: u32,
}

impl RingState {
    /// `entries` must be a power of two of at least 2.
    pub fn new(entries: u32) -> Option<RingState> {
        (entries >= 2 && entries.is_power_of_two()).then_some(RingState {
            entries,
            put: 0,
            get: 0,
        })
    }

    /// Entries in the ring.
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// The next entry the CPU writes.
    pub fn put(&self) -> u32 {
        self.put
    }

    /// The next entry the GPU fetches, as last observed.
    pub fn get(&self) -> u32 {
        self.get
    }

    /// Entries written but not yet fetched by the GPU.
    pub fn pending(&self) -> u32 {
        self.put.wrapping_sub(self.get) & (self.entries - 1)
    }

    /// Entries that can be written without overwriting one the GPU has not fetched.
    pub fn free(&self) -> u32 {
        self.entries - 1 - self.pending()
    }

    /// Whether the GPU has fetched every entry written.
    pub fn is_empty(&self) -> bool {
        self.put == self.get
    }

    /// Records the GPU's GP_GET. A value outside the ring is ignored (it would be a torn or bogus read).
    pub fn observe_get(&mut self, get: u32) -> bool {
        if get >= self.entries {
            return false;
        }
        // GET only moves forward through the pending entries; anything else is not a valid observation.
        let advanced = get.wrapping_sub(self.get) & (self.entries - 1);
        if advanced > self.pending() {
            return false;
        }
        self.get = get;
        true
    }

    /// Claims the slot at `put` and advances it; None when the ring is full.
    pub fn push(&mut self) -> Option<u32> {
        if self.free() == 0 {
            return None;
        }
        let slot = self.put;
        self.put = (self.put + 1) & (self.entries - 1);
        Some(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_full_and_wrap() {
        let mut r = RingState::new(4).unwrap();
        assert!(r.is_empty());
        assert_eq!(r.free(), 3);
        assert_eq!((r.push(), r.push(), r.push()), (Some(0), Some(1), Some(2)));
        assert_eq!(r.free(), 0);
        assert_eq!(
            r.push(),
            None,
            "a full ring never overwrites an unfetched entry"
        );
        assert!(r.observe_get(2));
        assert_eq!(r.free(), 2);
        assert_eq!(
            (r.push(), r.push()),
            (Some(3), Some(0)),
            "put wraps to slot 0"
        );
        assert_eq!(r.pending(), 3);
        assert!(r.observe_get(1));
        assert_eq!(r.pending(), 0);
        assert!(r.is_empty());
    }

    #[test]
    fn bogus_get_values_are_ignored() {
        let mut r = RingState::new(8).unwrap();
        r.push();
        r.push();
        assert!(!r.observe_get(8), "outside the ring");
        assert!(!r.observe_get(5), "beyond put");
        assert!(r.observe_get(2));
        assert!(r.is_empty());
    }

    #[test]
    fn sizes_must_be_powers_of_two() {
        assert!(RingState::new(0).is_none());
        assert!(RingState::new(1).is_none());
        assert!(RingState::new(1000).is_none());
        assert!(RingState::new(1024).is_some());
    }

    #[test]
    fn many_wraps_keep_invariants() {
        let mut r = RingState::new(16).unwrap();
        let mut pushed = 0u64;
        for i in 0..10_000u32 {
            while r.push().is_some() {
                pushed += 1;
            }
            assert_eq!(r.free(), 0);
            let get = (r.get() + 1 + i % 15) & 15;
            assert!(r.observe_get(get));
        }
        assert!(pushed > 16 * 100);
    }
}

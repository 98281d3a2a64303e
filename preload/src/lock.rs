//! The engine's lock, released with a plain store.
//!
//! A launch ends with the doorbell, an uncached store to the GPU. Any locked instruction after it (the `xchg` that
//! releases `std::sync::Mutex`, a reference count) waits until that store and the launch's write-combined stores
//! have left the core: about 0.3 µs on an H100 host, which was most of what the hook added after APEX's launch.
//! On x86 a release store is a plain `mov`, which waits for nothing, so this lock releases with one. It takes no
//! futex: a thread that finds it held spins briefly, then yields, then sleeps in short steps (the preload's lock is
//! held for microseconds, except while a module loads or a queue is built).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A lock around a `T`, released with a plain store.
pub(crate) struct StoreLock<T> {
    held: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached through a guard, and one guard exists at a time (`held`).
unsafe impl<T: Send> Sync for StoreLock<T> {}

/// Access to the locked value; releases the lock when dropped.
pub(crate) struct Guard<'a, T> {
    lock: &'a StoreLock<T>,
}

impl<T> StoreLock<T> {
    /// A lock around `value`.
    pub(crate) const fn new(value: T) -> StoreLock<T> {
        StoreLock {
            held: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock, waiting while another thread holds it.
    pub(crate) fn lock(&self) -> Guard<'_, T> {
        let mut tries = 0u32;
        loop {
            if !self.held.load(Ordering::Relaxed)
                && self
                    .held
                    .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return Guard { lock: self };
            }
            tries = tries.saturating_add(1);
            if tries < 64 {
                std::hint::spin_loop();
            } else if tries < 1024 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

impl<T> std::ops::Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard holds the lock.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> std::ops::DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard holds the lock, and is borrowed mutably.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        // A release store: a plain `mov` on x86, no locked instruction.
        self.lock.held.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn one_holder_at_a_time() {
        let lock = Arc::new(StoreLock::new(0u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let l = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        let mut g = l.lock();
                        // A read-modify-write split in two: lost updates if two threads were inside.
                        let v = *g;
                        std::hint::black_box(&v);
                        *g = v + 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.lock(), 40_000);
    }
}

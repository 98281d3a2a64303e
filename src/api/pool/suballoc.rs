//! The direct path's pool allocator, without hardware: size classes, the large-block path, stream-ordered reuse by
//! queue and timeline value, the release threshold, trimming and statistics.
//!
//! Memory comes in chunks the caller allocates (RM video memory on the direct path; anything in the tests), asked
//! for by [`Alloc::Need`]. A chunk of a size class is cut into equal blocks; a request above the large threshold
//! gets a chunk of its own. Every block not handed out sits in exactly one intrusive list: the free list of the
//! queue that freed it (newest first, so values rise from tail to head: the queue's timeline is monotonic), or the
//! class's ready list (never used, or freed with no queue to wait for). A hit moves one block between lists and
//! touches no heap: the metadata of every block is allocated with its chunk.
//!
//! Reuse follows stream order: a queue takes back its own freed blocks at once (its later work runs after the work
//! before the free), another queue only once the freeing queue's timeline has reached the value the free recorded
//! ([`Clock::reached`], a read of the timeline's semaphore, no system call).

/// Every block is a multiple of this many bytes and aligned to it (chunks are page-aligned).
pub(crate) const GRANULE: u64 = 256;
/// Requests up to this many bytes are small blocks: a class every [`GRANULE`] bytes. Above, four classes per
/// power of two.
pub(crate) const SMALL_LIMIT: u64 = 1024;

/// Where a queue's timeline stands, without a system call.
pub(crate) trait Clock {
    /// Whether the queue's timeline has reached `value`.
    fn reached(&self, value: u64) -> bool;
}

/// The size class of a request of `bytes` (at least 1).
pub(crate) fn class_of(bytes: u64) -> usize {
    let s = bytes.max(1).div_ceil(GRANULE) * GRANULE;
    if s <= SMALL_LIMIT {
        return (s / GRANULE - 1) as usize;
    }
    // 2^p < s <= 2^(p+1), p >= 10: four classes of 2^(p-2) bytes each above 2^p.
    let p = 63 - u64::from((s - 1).leading_zeros());
    let step = 1u64 << (p - 2);
    let idx = (s - (1u64 << p)).div_ceil(step);
    (4 + (p - 10) * 4 + idx - 1) as usize
}

/// The block size of class `class`.
pub(crate) fn class_size(class: usize) -> u64 {
    if class < 4 {
        return (class as u64 + 1) * GRANULE;
    }
    let k = class as u64 - 4;
    let p = 10 + k / 4;
    (1u64 << p) + (k % 4 + 1) * (1u64 << (p - 2))
}

/// What a dedicated (large) allocation of `bytes` is rounded to: 64 KiB, or 2 MiB from 8 MiB on (the page size
/// RM video memory of that size gets).
pub(crate) fn large_size(bytes: u64) -> u64 {
    let page = if bytes >= 8 << 20 { 2 << 20 } else { 64 << 10 };
    bytes.div_ceil(page).saturating_mul(page)
}

/// How the allocator is set up (checked by the caller).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Config {
    /// Bytes of each chunk the size classes are cut from.
    pub chunk_bytes: u64,
    /// Requests above this many bytes get a chunk of their own.
    pub large_threshold: u64,
    /// Bytes of reserved memory above which idle chunks are released.
    pub release_threshold: u64,
    /// The most bytes the allocator may reserve.
    pub reserve_limit: Option<u64>,
}

/// A block's name: its chunk and its index there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BlockId(u64);

impl BlockId {
    fn new(chunk: usize, index: usize) -> BlockId {
        BlockId(((chunk as u64) << 32) | index as u64)
    }
    fn chunk(self) -> usize {
        (self.0 >> 32) as usize
    }
    fn index(self) -> usize {
        (self.0 & 0xffff_ffff) as usize
    }
}

/// A block handed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    /// Its name, for [`Suballocator::free`].
    pub id: BlockId,
    /// Its device address.
    pub ptr: u64,
    /// Its size (its class's, or its chunk's for a large block).
    pub bytes: u64,
}

/// A chunk the allocator needs before it can serve a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Need {
    /// The size class, or [`LARGE`] for a dedicated chunk.
    pub class: u32,
    /// Bytes to allocate.
    pub bytes: u64,
}

/// The answer to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Alloc {
    /// Served from memory the allocator holds.
    Hit(Block),
    /// A chunk must be allocated first ([`Suballocator::add_chunk`] serves the request from it).
    Need(Need),
}

/// A request the reserve limit does not allow, even after idle chunks were released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OverLimit {
    /// The limit.
    pub limit: u64,
    /// Bytes the chunk would have added.
    pub needed: u64,
}

/// The class of a dedicated chunk.
pub(crate) const LARGE: u32 = u32::MAX;
/// No queue: a ready block, or one handed out with no queue.
pub(crate) const NO_SLOT: u32 = u32::MAX;
/// A chunk freed by more than one queue since its frees were last seen complete.
const MULTI: u32 = u32::MAX - 1;
const NIL: u64 = u64::MAX;

#[derive(Clone, Copy, Debug)]
struct Meta {
    prev: u64,
    next: u64,
    /// The value the free recorded on its queue.
    value: u64,
    /// Free: the list it is in (a queue's slot, or [`NO_SLOT`] for the ready list). In use: the queue it was
    /// allocated on.
    slot: u32,
    in_use: bool,
}

const META: Meta = Meta {
    prev: NIL,
    next: NIL,
    value: 0,
    slot: NO_SLOT,
    in_use: false,
};

#[derive(Debug)]
struct Chunk<C> {
    payload: C,
    base: u64,
    bytes: u64,
    class: u32,
    block: u64,
    meta: Box<[Meta]>,
    in_use: u32,
    /// The queue whose frees this chunk waits for ([`NO_SLOT`]: none; [`MULTI`]: several, see the blocks), and the
    /// highest value they recorded.
    wait_slot: u32,
    wait_value: u64,
}

#[derive(Clone, Copy, Debug)]
struct List {
    /// The newest block.
    head: u64,
    /// The oldest block.
    tail: u64,
}

const EMPTY: List = List {
    head: NIL,
    tail: NIL,
};

#[derive(Debug)]
struct Slot<K> {
    queue: u64,
    clock: K,
    /// Per class, the blocks this queue freed.
    lists: Box<[List]>,
    /// Bytes of blocks allocated on this queue and not freed yet.
    held: u64,
    /// The highest value a free on this queue recorded.
    max_pending: u64,
}

#[derive(Clone, Copy, Debug)]
enum ListRef {
    Ready(usize),
    Slot(u32, usize),
}

/// Counters of a [`Suballocator`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Stats {
    /// Bytes of chunks held.
    pub reserved: u64,
    /// Bytes of blocks handed out.
    pub in_use: u64,
    /// Blocks handed out.
    pub blocks: u64,
    /// Requests served from memory already held.
    pub hits: u64,
    /// Requests that needed a new chunk.
    pub misses: u64,
    /// Chunks held.
    pub chunks: u64,
    /// The most bytes ever reserved at once.
    pub reserved_high: u64,
    /// The most bytes ever in use at once.
    pub in_use_high: u64,
}

/// The allocator: chunks of payload `C` (what frees the memory when dropped), queues known by clocks `K`.
#[derive(Debug)]
pub(crate) struct Suballocator<C, K> {
    config: Config,
    classes: usize,
    chunks: Vec<Option<Chunk<C>>>,
    free_ids: Vec<usize>,
    slots: Vec<Option<Slot<K>>>,
    ready: Box<[List]>,
    /// Free large blocks: chunk, slot, value. Its capacity covers every large chunk, so a free never grows it.
    large_free: Vec<(usize, u32, u64)>,
    stats: Stats,
    /// Chunks released, for the caller to drop outside its lock.
    released: Vec<C>,
}

impl<C, K: Clock> Suballocator<C, K> {
    /// An empty allocator.
    pub fn new(config: Config) -> Suballocator<C, K> {
        let classes = class_of(config.large_threshold) + 1;
        Suballocator {
            config,
            classes,
            chunks: Vec::new(),
            free_ids: Vec::new(),
            slots: Vec::new(),
            ready: vec![EMPTY; classes].into_boxed_slice(),
            large_free: Vec::new(),
            stats: Stats::default(),
            released: Vec::new(),
        }
    }

    /// How it is set up.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Sets the release threshold; releases idle chunks above it.
    pub fn set_release_threshold(&mut self, bytes: u64) {
        self.config.release_threshold = bytes;
        if self.stats.reserved > bytes {
            self.release_over(bytes);
        }
    }

    /// The counters.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Bytes in use per queue that allocated them, queues holding none left out.
    pub fn held_by(&self) -> Vec<(u64, u64)> {
        self.slots
            .iter()
            .flatten()
            .filter(|s| s.held > 0)
            .map(|s| (s.queue, s.held))
            .collect()
    }

    /// The slot of queue `queue`, registered with the clock `clock` makes on its first use.
    #[inline]
    pub fn slot(&mut self, queue: u64, clock: impl FnOnce() -> K) -> u32 {
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(s) = s
                && s.queue == queue
            {
                return i as u32;
            }
        }
        let slot = Slot {
            queue,
            clock: clock(),
            lists: vec![EMPTY; self.classes].into_boxed_slice(),
            held: 0,
            max_pending: 0,
        };
        match self.slots.iter().position(Option::is_none) {
            Some(i) => {
                self.slots[i] = Some(slot);
                i as u32
            }
            None => {
                self.slots.push(Some(slot));
                (self.slots.len() - 1) as u32
            }
        }
    }

    /// Queues with frees not yet known complete: each clock and the highest value its frees recorded.
    pub fn pending(&self) -> impl Iterator<Item = (&K, u64)> {
        self.slots
            .iter()
            .flatten()
            .filter(|s| !s.clock.reached(s.max_pending))
            .map(|s| (&s.clock, s.max_pending))
    }

    /// Serves `bytes` for the queue in `slot` from memory held, or says what chunk it needs.
    #[inline]
    pub fn alloc(&mut self, slot: u32, bytes: u64) -> Result<Alloc, OverLimit> {
        let got = if bytes > self.config.large_threshold {
            self.take_large(slot, large_size(bytes))
        } else {
            self.take_class(slot, class_of(bytes))
        };
        if let Some(id) = got {
            self.stats.hits += 1;
            return Ok(Alloc::Hit(self.hand_out(id, slot)));
        }
        let need = if bytes > self.config.large_threshold {
            Need {
                class: LARGE,
                bytes: large_size(bytes),
            }
        } else {
            Need {
                class: class_of(bytes) as u32,
                bytes: self.config.chunk_bytes,
            }
        };
        // Before reserving more, give back what the threshold and the limit say is too much.
        let after = self.stats.reserved.saturating_add(need.bytes);
        if after > self.config.release_threshold {
            self.release_over(self.config.release_threshold.saturating_sub(need.bytes));
        }
        if let Some(limit) = self.config.reserve_limit
            && self.stats.reserved.saturating_add(need.bytes) > limit
        {
            self.release_over(limit.saturating_sub(need.bytes));
            if self.stats.reserved.saturating_add(need.bytes) > limit {
                return Err(OverLimit {
                    limit,
                    needed: need.bytes,
                });
            }
        }
        Ok(Alloc::Need(need))
    }

    /// Adds the chunk `need` asked for (`bytes` at `base`, at least `need.bytes`), and serves the request from it.
    pub fn add_chunk(&mut self, slot: u32, need: Need, payload: C, base: u64, bytes: u64) -> Block {
        let (block, n) = if need.class == LARGE {
            (bytes, 1)
        } else {
            let block = class_size(need.class as usize);
            (block, (bytes / block).max(1))
        };
        let chunk = Chunk {
            payload,
            base,
            bytes,
            class: need.class,
            block,
            meta: vec![META; n as usize].into_boxed_slice(),
            in_use: 0,
            wait_slot: NO_SLOT,
            wait_value: 0,
        };
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.chunks[id] = Some(chunk);
                id
            }
            None => {
                self.chunks.push(Some(chunk));
                self.chunks.len() - 1
            }
        };
        self.stats.reserved += bytes;
        self.stats.reserved_high = self.stats.reserved_high.max(self.stats.reserved);
        self.stats.chunks += 1;
        self.stats.misses += 1;
        let first = BlockId::new(id, 0);
        if need.class == LARGE {
            // Room for this chunk's entry: a free never grows the list.
            self.large_free.reserve(1);
        } else {
            // The other blocks are ready, lowest address first out.
            for i in (1..n as usize).rev() {
                self.push_head(ListRef::Ready(need.class as usize), BlockId::new(id, i));
            }
        }
        self.hand_out(first, slot)
    }

    /// Takes block `id` back, freed on the queue in `slot` once its timeline reaches `value` ([`NO_SLOT`]: free
    /// for any queue at once). Releases idle chunks if the release threshold is exceeded.
    #[inline]
    pub fn free(&mut self, id: BlockId, slot: u32, value: u64) {
        let slot = if self.slot_ref(slot).is_some() {
            slot
        } else {
            NO_SLOT
        };
        let Some(chunk) = self.chunks.get_mut(id.chunk()).and_then(Option::as_mut) else {
            return;
        };
        let Some(m) = chunk.meta.get_mut(id.index()) else {
            return;
        };
        if !m.in_use {
            return;
        }
        let owner = m.slot;
        m.in_use = false;
        m.slot = slot;
        m.value = value;
        chunk.in_use -= 1;
        let (class, block, idle) = (chunk.class, chunk.block, chunk.in_use == 0);
        if slot != NO_SLOT {
            if chunk.wait_slot == NO_SLOT || chunk.wait_slot == slot {
                chunk.wait_slot = slot;
                chunk.wait_value = chunk.wait_value.max(value);
            } else {
                chunk.wait_slot = MULTI;
            }
        }
        self.stats.in_use -= block;
        self.stats.blocks -= 1;
        if let Some(s) = self.slot_mut(owner) {
            s.held -= block;
        }
        if let Some(s) = self.slot_mut(slot) {
            s.max_pending = s.max_pending.max(value);
        }
        if class == LARGE {
            self.large_free.push((id.chunk(), slot, value));
        } else if slot == NO_SLOT {
            self.push_head(ListRef::Ready(class as usize), id);
        } else {
            self.push_head(ListRef::Slot(slot, class as usize), id);
        }
        if idle && self.stats.reserved > self.config.release_threshold {
            self.release_over(self.config.release_threshold);
        }
    }

    /// Releases idle chunks (no block in use, every free complete) until at most `keep` bytes are reserved, and
    /// forgets queues with nothing left in the pool. The chunks go to [`take_released`](Self::take_released).
    /// Returns the bytes released.
    pub fn release_over(&mut self, keep: u64) -> u64 {
        let before = self.stats.reserved;
        // Large chunks first: the most memory for the fewest releases.
        for large in [true, false] {
            for id in 0..self.chunks.len() {
                if self.stats.reserved <= keep {
                    break;
                }
                let is_large = matches!(&self.chunks[id], Some(c) if c.class == LARGE);
                if is_large == large && self.releasable(id) {
                    self.release(id);
                }
            }
        }
        self.forget_idle_queues();
        before - self.stats.reserved
    }

    /// The chunks released since the last call, to drop (free) outside the caller's lock.
    pub fn take_released(&mut self) -> Vec<C> {
        if self.released.is_empty() {
            Vec::new()
        } else {
            std::mem::take(&mut self.released)
        }
    }

    fn take_class(&mut self, slot: u32, class: usize) -> Option<BlockId> {
        // The queue's own frees: at once, newest (warmest) first.
        if let Some(s) = self.slot_ref(slot) {
            let head = s.lists[class].head;
            if head != NIL {
                let id = BlockId(head);
                self.unlink(ListRef::Slot(slot, class), id);
                return Some(id);
            }
        }
        // Other queues' frees whose values their timelines have reached (the oldest of each first).
        for o in 0..self.slots.len() as u32 {
            if o == slot {
                continue;
            }
            let Some(s) = self.slot_ref(o) else { continue };
            let tail = s.lists[class].tail;
            if tail != NIL && s.clock.reached(self.meta(BlockId(tail)).value) {
                let id = BlockId(tail);
                self.unlink(ListRef::Slot(o, class), id);
                return Some(id);
            }
        }
        let head = self.ready[class].head;
        if head != NIL {
            let id = BlockId(head);
            self.unlink(ListRef::Ready(class), id);
            return Some(id);
        }
        None
    }

    fn take_large(&mut self, slot: u32, bytes: u64) -> Option<BlockId> {
        // The smallest block of at most a quarter more than asked for that this queue may use now.
        let mut best: Option<(usize, u64)> = None;
        for (i, &(chunk, s, value)) in self.large_free.iter().enumerate() {
            let Some(c) = self.chunks.get(chunk).and_then(Option::as_ref) else {
                continue;
            };
            if c.bytes < bytes || c.bytes - bytes > bytes / 4 {
                continue;
            }
            if best.is_some_and(|(_, b)| b <= c.bytes) {
                continue;
            }
            let usable = s == NO_SLOT
                || s == slot
                || self.slot_ref(s).is_none_or(|q| q.clock.reached(value));
            if usable {
                best = Some((i, c.bytes));
            }
        }
        let (i, _) = best?;
        let (chunk, _, _) = self.large_free.swap_remove(i);
        Some(BlockId::new(chunk, 0))
    }

    fn hand_out(&mut self, id: BlockId, slot: u32) -> Block {
        let slot = if self.slot_ref(slot).is_some() {
            slot
        } else {
            NO_SLOT
        };
        let chunk = self.chunk_mut(id.chunk());
        chunk.in_use += 1;
        let (ptr, bytes) = (chunk.base + id.index() as u64 * chunk.block, chunk.block);
        let m = &mut chunk.meta[id.index()];
        m.in_use = true;
        m.slot = slot;
        m.prev = NIL;
        m.next = NIL;
        self.stats.in_use += bytes;
        self.stats.in_use_high = self.stats.in_use_high.max(self.stats.in_use);
        self.stats.blocks += 1;
        if let Some(s) = self.slot_mut(slot) {
            s.held += bytes;
        }
        Block { id, ptr, bytes }
    }

    /// Whether chunk `id` holds no block in use and every free of its blocks is complete.
    fn releasable(&mut self, id: usize) -> bool {
        let Some(c) = self.chunks[id].as_ref() else {
            return false;
        };
        if c.in_use > 0 {
            return false;
        }
        let done = |slots: &[Option<Slot<K>>], s: u32, v: u64| {
            s == NO_SLOT
                || slots
                    .get(s as usize)
                    .and_then(Option::as_ref)
                    .is_none_or(|q| q.clock.reached(v))
        };
        let ok = match c.wait_slot {
            NO_SLOT => true,
            MULTI => c.meta.iter().all(|m| done(&self.slots, m.slot, m.value)),
            s => done(&self.slots, s, c.wait_value),
        };
        if ok && let Some(c) = self.chunks[id].as_mut() {
            c.wait_slot = NO_SLOT;
            c.wait_value = 0;
        }
        ok
    }

    fn release(&mut self, id: usize) {
        let (class, n) = {
            let c = self.chunk_mut(id);
            (c.class, c.meta.len())
        };
        if class == LARGE {
            self.large_free.retain(|&(c, _, _)| c != id);
        } else {
            for i in 0..n {
                let b = BlockId::new(id, i);
                let slot = self.meta(b).slot;
                let list = if slot == NO_SLOT {
                    ListRef::Ready(class as usize)
                } else {
                    ListRef::Slot(slot, class as usize)
                };
                self.unlink(list, b);
            }
        }
        if let Some(c) = self.chunks[id].take() {
            self.stats.reserved -= c.bytes;
            self.stats.chunks -= 1;
            self.released.push(c.payload);
            self.free_ids.push(id);
        }
    }

    /// Forgets queues with no block held, none on their lists and every free complete (a queue used again is
    /// registered again).
    fn forget_idle_queues(&mut self) {
        for i in 0..self.slots.len() {
            let idle = match &self.slots[i] {
                Some(s) => {
                    s.held == 0
                        && s.lists.iter().all(|l| l.head == NIL)
                        && s.clock.reached(s.max_pending)
                        && !self.large_free.iter().any(|&(_, q, _)| q == i as u32)
                }
                None => false,
            };
            if idle {
                self.slots[i] = None;
                for c in self.chunks.iter_mut().flatten() {
                    if c.wait_slot == i as u32 {
                        c.wait_slot = NO_SLOT;
                    }
                }
            }
        }
    }

    fn slot_ref(&self, slot: u32) -> Option<&Slot<K>> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    fn slot_mut(&mut self, slot: u32) -> Option<&mut Slot<K>> {
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }

    fn chunk_mut(&mut self, id: usize) -> &mut Chunk<C> {
        match self.chunks.get_mut(id).and_then(Option::as_mut) {
            Some(c) => c,
            None => unreachable!("pool chunk {id} is gone while a block of it is listed"),
        }
    }

    fn meta(&self, id: BlockId) -> &Meta {
        match self.chunks.get(id.chunk()).and_then(Option::as_ref) {
            Some(c) => &c.meta[id.index()],
            None => unreachable!(
                "pool chunk {} is gone while a block of it is listed",
                id.chunk()
            ),
        }
    }

    fn meta_mut(&mut self, id: BlockId) -> &mut Meta {
        &mut self.chunk_mut(id.chunk()).meta[id.index()]
    }

    fn list(&mut self, r: ListRef) -> &mut List {
        match r {
            ListRef::Ready(class) => &mut self.ready[class],
            ListRef::Slot(slot, class) => match self.slots.get_mut(slot as usize) {
                Some(Some(s)) => &mut s.lists[class],
                _ => unreachable!("pool queue slot {slot} is gone while a block is on its list"),
            },
        }
    }

    fn push_head(&mut self, r: ListRef, id: BlockId) {
        let mut l = *self.list(r);
        {
            let m = self.meta_mut(id);
            m.prev = NIL;
            m.next = l.head;
        }
        if l.head == NIL {
            l.tail = id.0;
        } else {
            self.meta_mut(BlockId(l.head)).prev = id.0;
        }
        l.head = id.0;
        *self.list(r) = l;
    }

    fn unlink(&mut self, r: ListRef, id: BlockId) {
        let (prev, next) = {
            let m = self.meta(id);
            (m.prev, m.next)
        };
        let mut l = *self.list(r);
        if prev == NIL {
            l.head = next;
        } else {
            self.meta_mut(BlockId(prev)).next = next;
        }
        if next == NIL {
            l.tail = prev;
        } else {
            self.meta_mut(BlockId(next)).prev = prev;
        }
        *self.list(r) = l;
        let m = self.meta_mut(id);
        m.prev = NIL;
        m.next = NIL;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;

    /// A queue's timeline the test moves by hand.
    #[derive(Clone, Debug, Default)]
    struct Tl(Rc<Cell<u64>>);

    impl Clock for Tl {
        fn reached(&self, value: u64) -> bool {
            self.0.get() >= value
        }
    }

    const MIB: u64 = 1 << 20;

    fn config() -> Config {
        Config {
            chunk_bytes: 2 * MIB,
            large_threshold: 512 << 10,
            release_threshold: u64::MAX,
            reserve_limit: None,
        }
    }

    /// An allocator whose chunks are numbered payloads at addresses the test makes up.
    struct Fixture {
        a: Suballocator<u32, Tl>,
        next_base: u64,
        made: u32,
    }

    impl Fixture {
        fn new(config: Config) -> Fixture {
            Fixture {
                a: Suballocator::new(config),
                next_base: 1 << 40,
                made: 0,
            }
        }

        fn alloc(&mut self, slot: u32, bytes: u64) -> Result<(Block, bool), OverLimit> {
            match self.a.alloc(slot, bytes)? {
                Alloc::Hit(b) => Ok((b, true)),
                Alloc::Need(need) => {
                    assert!(need.bytes >= bytes);
                    let base = self.next_base;
                    self.next_base += need.bytes.next_multiple_of(2 * MIB);
                    self.made += 1;
                    Ok((
                        self.a.add_chunk(slot, need, self.made, base, need.bytes),
                        false,
                    ))
                }
            }
        }
    }

    #[test]
    fn classes_round_up_by_at_most_a_quarter_and_stay_256_aligned() {
        assert_eq!(class_of(1), 0);
        assert_eq!(class_size(0), 256);
        assert_eq!(class_of(256), 0);
        assert_eq!(class_of(257), 1);
        assert_eq!(class_of(1024), 3);
        assert_eq!(class_size(4), 1280);
        assert_eq!(class_of(2048), 7);
        assert_eq!(class_size(8), 2560);
        for c in 0..80 {
            assert_eq!(class_of(class_size(c)), c, "class {c}");
            assert!(class_size(c + 1) > class_size(c));
            assert_eq!(class_size(c) % GRANULE, 0);
        }
        for bytes in (1..(4 * MIB)).step_by(97) {
            let s = class_size(class_of(bytes));
            assert!(s >= bytes);
            if bytes > SMALL_LIMIT {
                assert!(s - bytes <= bytes / 4 + GRANULE, "{bytes} -> {s}");
            } else {
                assert!(s - bytes < GRANULE);
            }
        }
        assert_eq!(large_size(1), 64 << 10);
        assert_eq!(large_size(9 * MIB + 1), 10 * MIB);
    }

    #[test]
    fn a_queue_reuses_its_own_free_at_once_and_another_only_after_the_fence() {
        let mut f = Fixture::new(config());
        let (ta, tb) = (Tl::default(), Tl::default());
        let a = f.a.slot(1, || ta.clone());
        let b = f.a.slot(2, || tb.clone());
        assert_eq!(f.a.slot(1, || unreachable!()), a);
        let (x, hit) = f.alloc(a, 1000).unwrap();
        assert!(!hit, "the first request makes a chunk");
        assert_eq!(x.bytes, 1024);
        assert_eq!(x.ptr % 256, 0);
        f.a.free(x.id, a, 10);
        // Queue B must not get x while A's timeline is below 10.
        let (y, hit) = f.alloc(b, 1000).unwrap();
        assert!(hit);
        assert_ne!(y.ptr, x.ptr);
        // Queue A gets it back at once (stream order).
        let (x2, _) = f.alloc(a, 1000).unwrap();
        assert_eq!(x2.ptr, x.ptr);
        f.a.free(x2.id, a, 11);
        ta.0.set(10);
        let (z, _) = f.alloc(b, 1000).unwrap();
        assert_ne!(z.ptr, x.ptr, "A's free at 11 is not complete");
        ta.0.set(11);
        let (z2, _) = f.alloc(b, 1000).unwrap();
        assert_eq!(z2.ptr, x.ptr, "A's free at 11 is complete: B takes it");
        let s = f.a.stats();
        assert_eq!((s.misses, s.hits, s.chunks), (1, 4, 1));
        assert_eq!(s.blocks, 3);
        assert_eq!(s.in_use, 3 * 1024);
        assert_eq!(f.a.held_by(), vec![(2, 3 * 1024)]);
    }

    #[test]
    fn the_oldest_free_of_another_queue_is_taken_first() {
        let mut f = Fixture::new(config());
        let (ta, tb) = (Tl::default(), Tl::default());
        let a = f.a.slot(1, || ta.clone());
        let b = f.a.slot(2, || tb.clone());
        let blocks: Vec<Block> = (0..3).map(|_| f.alloc(a, 256).unwrap().0).collect();
        for (i, x) in blocks.iter().enumerate() {
            f.a.free(x.id, a, 5 + i as u64);
        }
        ta.0.set(6);
        assert_eq!(f.alloc(b, 256).unwrap().0.ptr, blocks[0].ptr);
        assert_eq!(f.alloc(b, 256).unwrap().0.ptr, blocks[1].ptr);
        let third = f.alloc(b, 256).unwrap().0.ptr;
        assert_ne!(third, blocks[2].ptr, "value 7 is not reached");
        // A takes its newest free first.
        assert_eq!(f.alloc(a, 256).unwrap().0.ptr, blocks[2].ptr);
    }

    #[test]
    fn large_requests_get_chunks_of_their_own_reused_by_size_and_fence() {
        let mut f = Fixture::new(config());
        let ta = Tl::default();
        let tb = Tl::default();
        let a = f.a.slot(1, || ta.clone());
        let b = f.a.slot(2, || tb.clone());
        let (x, hit) = f.alloc(a, 3 * MIB).unwrap();
        assert!(!hit);
        assert_eq!(x.bytes, 3 * MIB);
        f.a.free(x.id, a, 4);
        // Too small a request for x (more than a quarter would be wasted), then one that fits.
        let (small, hit) = f.alloc(a, MIB).unwrap();
        assert!(!hit);
        assert_ne!(small.ptr, x.ptr);
        assert!(
            !f.alloc(b, 3 * MIB - 1000).unwrap().1,
            "fence 4 not reached"
        );
        ta.0.set(4);
        let (y, hit) = f.alloc(b, 3 * MIB - 1000).unwrap();
        assert!(hit);
        assert_eq!(y.ptr, x.ptr);
        assert_eq!(f.a.stats().chunks, 3);
    }

    #[test]
    fn trim_releases_idle_chunks_once_their_frees_are_complete() {
        let mut f = Fixture::new(config());
        let ta = Tl::default();
        let a = f.a.slot(1, || ta.clone());
        let x = f.alloc(a, 4096).unwrap().0;
        let y = f.alloc(a, 100_000).unwrap().0;
        let z = f.alloc(a, MIB).unwrap().0;
        assert_eq!(f.a.stats().reserved, 2 * MIB + 2 * MIB + MIB);
        f.a.free(x.id, a, 1);
        f.a.free(y.id, a, 2);
        // z still in use, frees pending: nothing goes.
        assert_eq!(f.a.release_over(0), 0);
        ta.0.set(1);
        assert_eq!(f.a.release_over(0), 2 * MIB, "x's chunk only");
        assert_eq!(f.a.take_released(), vec![1]);
        ta.0.set(2);
        f.a.free(z.id, NO_SLOT, 0);
        // Keeping 2 MiB: the large chunk goes first (1 MiB), then y's (2 MiB) to get under.
        assert_eq!(f.a.release_over(2 * MIB), MIB);
        assert_eq!(f.a.stats().reserved, 2 * MIB);
        assert_eq!(f.a.release_over(0), 2 * MIB);
        let mut gone = f.a.take_released();
        gone.sort();
        assert_eq!(gone, vec![2, 3]);
        let s = f.a.stats();
        assert_eq!((s.reserved, s.chunks, s.in_use, s.blocks), (0, 0, 0, 0));
        assert!(f.a.held_by().is_empty());
        // The queue was forgotten with nothing left in the pool; registered again, it allocates as before.
        let a = f.a.slot(1, || ta.clone());
        let w = f.alloc(a, 4096).unwrap();
        assert!(!w.1);
        assert_eq!(f.a.stats().chunks, 1);
    }

    #[test]
    fn the_release_threshold_gives_back_idle_chunks_on_free_and_before_growing() {
        let mut f = Fixture::new(Config {
            release_threshold: 2 * MIB,
            ..config()
        });
        let ta = Tl::default();
        let a = f.a.slot(1, || ta.clone());
        let x = f.alloc(a, 256).unwrap().0;
        let y = f.alloc(a, 4096).unwrap().0;
        assert_eq!(f.a.stats().reserved, 4 * MIB);
        // Freed with no queue to wait for: the chunk is idle and complete, over the threshold: released.
        f.a.free(x.id, NO_SLOT, 0);
        assert_eq!(f.a.stats().reserved, 2 * MIB);
        assert_eq!(f.a.take_released(), vec![1]);
        // Freed on a queue still running: kept until it completes; a miss then releases it first.
        f.a.free(y.id, a, 9);
        assert_eq!(f.a.stats().reserved, 2 * MIB);
        ta.0.set(9);
        let (_, hit) = f.alloc(a, 20_000).unwrap();
        assert!(!hit);
        assert_eq!(f.a.take_released(), vec![2]);
        assert_eq!(f.a.stats().reserved, 2 * MIB);
        f.a.set_release_threshold(0);
        assert_eq!(f.a.stats().reserved, 2 * MIB, "a block is in use");
    }

    #[test]
    fn the_reserve_limit_refuses_after_releasing_what_it_can() {
        let mut f = Fixture::new(Config {
            reserve_limit: Some(4 * MIB),
            ..config()
        });
        let ta = Tl::default();
        let a = f.a.slot(1, || ta.clone());
        let x = f.alloc(a, 256).unwrap().0;
        let _y = f.alloc(a, 4096).unwrap().0;
        let err = f.alloc(a, 8192).unwrap_err();
        assert_eq!(
            err,
            OverLimit {
                limit: 4 * MIB,
                needed: 2 * MIB
            }
        );
        // Once x's chunk is idle and its free complete, it makes room.
        f.a.free(x.id, a, 3);
        assert!(f.alloc(a, 8192).is_err());
        ta.0.set(3);
        let (_, hit) = f.alloc(a, 8192).unwrap();
        assert!(!hit);
        assert_eq!(f.a.take_released(), vec![1]);
    }

    #[test]
    fn many_cycles_over_many_queues_keep_the_books_balanced() {
        let mut f = Fixture::new(config());
        let clocks: Vec<Tl> = (0..4).map(|_| Tl::default()).collect();
        let slots: Vec<u32> = (0..4)
            .map(|i| f.a.slot(i as u64 + 1, || clocks[i].clone()))
            .collect();
        let mut live: Vec<(Block, usize)> = Vec::new();
        let mut seed = 12345u64;
        let mut rnd = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut values = [0u64; 4];
        let mut requests = 0u64;
        for _ in 0..20_000 {
            let q = (rnd() % 4) as usize;
            if live.len() < 64 && rnd() % 2 == 0 {
                let bytes = 1 + rnd() % (if rnd() % 16 == 0 { 4 * MIB } else { 64 << 10 });
                let (b, _) = f.alloc(slots[q], bytes).unwrap();
                requests += 1;
                assert!(b.bytes >= bytes);
                assert_eq!(b.ptr % GRANULE, 0);
                // No two live blocks overlap.
                for (o, _) in &live {
                    assert!(b.ptr + b.bytes <= o.ptr || o.ptr + o.bytes <= b.ptr);
                }
                live.push((b, q));
            } else if !live.is_empty() {
                let i = (rnd() as usize) % live.len();
                let (b, _) = live.swap_remove(i);
                values[q] += 1;
                f.a.free(b.id, slots[q], values[q]);
            }
            // Queues complete their work at their own pace.
            let q = (rnd() % 4) as usize;
            let v = values[q].saturating_sub(rnd() % 3);
            if v > clocks[q].0.get() {
                clocks[q].0.set(v);
            }
        }
        let s = f.a.stats();
        assert_eq!(s.blocks, live.len() as u64);
        assert_eq!(s.in_use, live.iter().map(|(b, _)| b.bytes).sum::<u64>());
        assert_eq!(s.hits + s.misses, requests);
        assert_eq!(s.misses, u64::from(f.made));
        for (b, _) in live.drain(..) {
            f.a.free(b.id, NO_SLOT, 0);
        }
        for (c, v) in clocks.iter().zip(values) {
            c.0.set(v);
        }
        f.a.release_over(0);
        let s = f.a.stats();
        assert_eq!((s.reserved, s.chunks, s.in_use, s.blocks), (0, 0, 0, 0));
        assert_eq!(f.a.take_released().len() as u32, f.made);
        assert_eq!(f.a.pending().count(), 0);
    }
}

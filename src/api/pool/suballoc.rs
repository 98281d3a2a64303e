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
mod tests;

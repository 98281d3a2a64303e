//! The preload's log subscriber, made safe for the program's exit: glibc runs thread-local destructors before
//! `atexit` handlers, so the final summary (written from one) must not reach the formatter, whose per-thread
//! buffer is gone by then (touching it panics, and a panic at that point aborts the program).

use std::sync::atomic::{AtomicBool, Ordering};

use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};

static EXITING: AtomicBool = AtomicBool::new(false);

/// From now on nothing is logged (the program is exiting).
pub(crate) fn exiting() {
    EXITING.store(true, Ordering::Relaxed);
}

/// Whether the program is exiting ([`exiting`] was called).
pub(crate) fn is_exiting() -> bool {
    EXITING.load(Ordering::Relaxed)
}

fn live() -> bool {
    !is_exiting()
}

/// `S`, silent once [`exiting`] was called. Interest is never cached as "always", so every event asks
/// [`Subscriber::enabled`] first.
pub(crate) struct ExitSafe<S>(pub(crate) S);

impl<S: Subscriber> Subscriber for ExitSafe<S> {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if self.0.register_callsite(metadata).is_never() {
            Interest::never()
        } else {
            Interest::sometimes()
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        live() && self.0.enabled(metadata)
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        self.0.max_level_hint()
    }

    fn new_span(&self, span: &Attributes<'_>) -> Id {
        self.0.new_span(span)
    }

    fn record(&self, span: &Id, values: &Record<'_>) {
        if live() {
            self.0.record(span, values)
        }
    }

    fn record_follows_from(&self, span: &Id, follows: &Id) {
        if live() {
            self.0.record_follows_from(span, follows)
        }
    }

    fn event(&self, event: &Event<'_>) {
        if live() {
            self.0.event(event)
        }
    }

    fn enter(&self, span: &Id) {
        if live() {
            self.0.enter(span)
        }
    }

    fn exit(&self, span: &Id) {
        if live() {
            self.0.exit(span)
        }
    }

    fn clone_span(&self, id: &Id) -> Id {
        self.0.clone_span(id)
    }

    fn try_close(&self, id: Id) -> bool {
        live() && self.0.try_close(id)
    }
}

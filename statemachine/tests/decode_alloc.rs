//! Decoding untrusted bytes allocates no more than the input could hold. A state blob
//! whose length prefix claims gigabytes is refused before anything is allocated for it
//! (a received snapshot, a stored one, a backup's: the node's decoders read them through
//! `State::decode` and `State::decode_from`).
//!
//! Its own test binary: the global allocator here records the largest single
//! allocation.

use allot_statemachine::testkit::Harness;
use allot_statemachine::State;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Largest;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Largest = Largest;

/// Every position of a real state's encoding overwritten with a varint length prefix
/// of 4 GiB − 16: no decode allocates as much as 16 MiB (bounded preallocations of up
/// to 1 MiB stay), from a slice or from a reader. (The regression itself is the next
/// test: this state's strings sit where a corrupt prefix fails sooner.)
#[test]
fn a_huge_length_prefix_allocates_nothing_for_it() {
    let mut h = Harness::world();
    h.tick();
    let good = h.state.encode();
    let huge = [0xFC, 0xF0, 0xFF, 0xFF, 0xFF];
    let mut refused = 0;
    for at in 1..good.len() {
        let mut bad = good[..at].to_vec();
        bad.extend_from_slice(&huge);
        bad.extend_from_slice(&good[at + 1..]);
        LARGEST.store(0, Ordering::Relaxed);
        let from_slice = State::decode(&bad);
        let from_reader = State::decode_from(std::io::BufReader::new(&bad[..]), bad.len() as u64);
        let largest = LARGEST.load(Ordering::Relaxed);
        assert!(
            largest < 16 << 20,
            "a prefix at byte {at} of {} allocated {largest} bytes",
            good.len()
        );
        refused += usize::from(from_slice.is_err() && from_reader.is_err());
    }
    assert!(
        refused > good.len() / 2,
        "{refused} of {} refused",
        good.len()
    );
}

/// The blob a review found: format 7, a zeroed ledger configuration, one tier whose
/// name claims 4 GiB − 16 bytes. Before, decoding it allocated and zeroed 4 GiB
/// (10.8 s here) before failing on the missing bytes.
#[test]
fn eleven_bytes_claiming_a_4_gib_name_allocate_nothing_for_it() {
    let blob = [7, 0, 0, 0, 0, 1, 0xFC, 0xF0, 0xFF, 0xFF, 0xFF];
    LARGEST.store(0, Ordering::Relaxed);
    assert!(State::decode(&blob).is_err());
    assert!(State::decode_from(&blob[..], blob.len() as u64).is_err());
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(largest < 16 << 20, "allocated {largest} bytes");
}

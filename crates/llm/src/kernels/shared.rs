//! A buffer that several threads write in disjoint parts (a forward pass's team between
//! barriers, a thread pool's work items), each part proved disjoint by the caller.

use std::ops::Range;

/// Holds a pointer into a slice that outlives the threads and is not touched otherwise while
/// they run.
pub struct Shared<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: access is coordinated by the caller (see `Shared::read` and `Shared::part`).
unsafe impl<T: Send> Sync for Shared<T> {}
unsafe impl<T: Send> Send for Shared<T> {}

impl<T> Shared<T> {
    pub fn new(v: &mut [T]) -> Shared<T> {
        Shared {
            ptr: v.as_mut_ptr(),
            len: v.len(),
        }
    }

    pub fn ptr(&self) -> *mut T {
        self.ptr
    }

    /// # Safety
    /// No thread writes the buffer while the slice is held.
    pub unsafe fn read(&self) -> &[T] {
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// # Safety
    /// No other thread reads or writes `range` while the slice is held.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn part(&self, range: Range<usize>) -> &mut [T] {
        assert!(range.start <= range.end && range.end <= self.len);
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }
}

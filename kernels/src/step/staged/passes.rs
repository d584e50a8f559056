//! [`Staged`]'s passes: making it, switching passes, and noting each launch and write into
//! the pass's signature.

use std::{
    cell::{Cell, RefCell},
    fmt::{self, Write as _},
    hash::{DefaultHasher, Hasher},
};

use super::{HashWriter, Pass, Signature, Staged};
use crate::step::kernels::Kernels;

impl<K: Kernels> Staged<K> {
    pub fn new(k: K) -> Self {
        Self {
            k,
            pass: Cell::new(Pass::Run),
            hasher: RefCell::new(DefaultHasher::new()),
            counts: Cell::new((0, 0)),
            trace: RefCell::new(None),
        }
    }

    /// Keeps each pass's launches and writes in words from now on.
    pub fn keep_trace(&self) {
        *self.trace.borrow_mut() = Some(Vec::new());
    }

    /// The launches and writes in words since the last call (with [`Self::keep_trace`]).
    pub fn take_trace(&self) -> Vec<String> {
        self.trace
            .borrow_mut()
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// The kernels it stages.
    pub fn inner(&self) -> &K {
        &self.k
    }

    /// Starts `pass` with a fresh signature.
    pub fn start(&self, pass: Pass) {
        self.pass.set(pass);
        *self.hasher.borrow_mut() = DefaultHasher::new();
        self.counts.set((0, 0));
    }

    /// The signature of the pass so far; the kernels run everything again.
    pub fn finish(&self) -> Signature {
        self.pass.set(Pass::Run);
        let (launches, writes) = self.counts.get();
        Signature {
            hash: self.hasher.borrow().finish(),
            launches,
            writes,
        }
    }

    /// Whether launches are folded into the signature (in the passes, not in a plain run).
    pub(super) fn noting(&self) -> bool {
        self.pass.get() != Pass::Run
    }

    pub(super) fn note(&self, tag: &str, addrs: &[usize], scalars: impl fmt::Debug) {
        if !self.noting() {
            return;
        }
        if let Some(trace) = self.trace.borrow_mut().as_mut() {
            trace.push(format!("{tag} {addrs:x?} {scalars:?}"));
        }
        let mut h = self.hasher.borrow_mut();
        h.write(tag.as_bytes());
        for &a in addrs {
            h.write_usize(a);
        }
        // Writing into a hasher cannot fail.
        let _ = write!(HashWriter(&mut h), "{scalars:?}");
    }

    /// A launch: noted, and run unless this is a plan pass.
    pub(super) fn launch(
        &self,
        tag: &str,
        addrs: &[usize],
        scalars: impl fmt::Debug,
        run: impl FnOnce(&K) -> Result<(), K::Error>,
    ) -> Result<(), K::Error> {
        self.note(tag, addrs, scalars);
        let (launches, writes) = self.counts.get();
        self.counts.set((launches + 1, writes));
        match self.pass.get() {
            Pass::Plan => Ok(()),
            Pass::Run | Pass::Launch => run(&self.k),
        }
    }

    /// A host write: noted (where, not what), and done unless this is a launch pass.
    pub(super) fn host_write(
        &self,
        tag: &str,
        dst: Option<usize>,
        run: impl FnOnce(&K) -> Result<(), K::Error>,
    ) -> Result<(), K::Error> {
        if let Some(dst) = dst {
            self.note(tag, &[dst], ());
        }
        let (launches, writes) = self.counts.get();
        self.counts.set((launches, writes + 1));
        match self.pass.get() {
            Pass::Launch => Ok(()),
            Pass::Run | Pass::Plan => run(&self.k),
        }
    }

    /// A new device buffer: refused in a launch pass (a graph replays fixed addresses).
    pub(super) fn new_buffer<T>(
        &self,
        make: impl FnOnce(&K) -> Result<T, K::Error>,
    ) -> Result<T, K::Error> {
        if self.pass.get() == Pass::Launch {
            return Err("a launch pass made a device buffer".to_owned().into());
        }
        make(&self.k)
    }

    /// A read to the host: only outside the passes.
    pub(super) fn host_read<T>(
        &self,
        read: impl FnOnce(&K) -> Result<T, K::Error>,
    ) -> Result<T, K::Error> {
        if self.pass.get() != Pass::Run {
            return Err("a pass read the device".to_owned().into());
        }
        read(&self.k)
    }
}

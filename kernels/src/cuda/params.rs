//! The arguments a kernel's typed launcher takes (`kernel_params.rs`, written by the build
//! script from each kernel's parameter list): a `const T*` parameter takes a buffer it
//! [`Reads`], a `T*` one a buffer it [`Writes`], each of the parameter's element type, and a
//! scalar one a `&` of the Rust type of its width. So an argument of the wrong type or width,
//! or out of order, does not compile.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchArgs, PushKernelArg as _};

/// Whether two kernels' `PARAMS` are equal (a `const fn`: call sites assert it at compile
/// time before launching both through one kernel's launcher).
pub(crate) const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// A device buffer of `T`s a kernel reads through a `const T*` (`const void*` takes any).
pub(crate) trait Reads<T> {
    fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>);
}

/// A device buffer of `T`s a kernel writes through a `T*`.
pub(crate) trait Writes<T> {
    fn push<'a>(&'a mut self, launch: &mut LaunchArgs<'a>);
}

impl<T> Reads<T> for CudaSlice<T> {
    fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>) {
        launch.arg(self);
    }
}

impl<T> Reads<T> for CudaView<'_, T> {
    fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>) {
        launch.arg(self);
    }
}

/// The null pointer: what a kernel reads as "not given" where its parameter says so.
static NULL: u64 = 0;

/// An optional input: `None` passes the null pointer.
impl<T, R: Reads<T> + ?Sized> Reads<T> for Option<&R> {
    fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>) {
        match self {
            Some(buffer) => buffer.push(launch),
            None => {
                launch.arg(&NULL);
            }
        }
    }
}

impl<T> Writes<T> for CudaSlice<T> {
    fn push<'a>(&'a mut self, launch: &mut LaunchArgs<'a>) {
        launch.arg(self);
    }
}

impl<T> Writes<T> for CudaViewMut<'_, T> {
    fn push<'a>(&'a mut self, launch: &mut LaunchArgs<'a>) {
        launch.arg(self);
    }
}

/// A buffer a kernel reads as another element type: the state pools (bytes at byte offsets,
/// whatever their element), weights' bf16 bits held as `u16`s, FP8 tiles' f32 scales held as
/// bytes. The call site says so; the buffer's alignment is the allocator's (256 bytes).
#[derive(Debug)]
pub(crate) struct Raw<'b, P>(pub(crate) &'b CudaSlice<P>);

impl<T, P> Reads<T> for Raw<'_, P> {
    fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>) {
        launch.arg(self.0);
    }
}

/// A buffer a kernel writes as another element type (see [`Raw`]).
#[derive(Debug)]
pub(crate) struct RawMut<'b, P>(pub(crate) &'b mut CudaSlice<P>);

impl<T, P> Writes<T> for RawMut<'_, P> {
    fn push<'a>(&'a mut self, launch: &mut LaunchArgs<'a>) {
        launch.arg(&mut *self.0);
    }
}

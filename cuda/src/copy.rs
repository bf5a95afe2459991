//! The buffers of the copy stream (docs/format.md, "Memory instructions"): an `offload` copies
//! each device buffer of a stash into page-locked host memory (`cuMemHostAlloc` through
//! cudarc's `alloc_pinned_with_flags`; only page-locked memory lets `cuMemcpy*Async` run
//! beside kernels, CUDA C++ Programming Guide, "Asynchronous Concurrent Execution"), a
//! `reload` copies them back into fresh device buffers. Host buffers are pooled by length:
//! `cuMemHostAlloc` pins pages and costs milliseconds, and a step offloads the same shapes
//! again and again (PipeOffload keeps its pinned buffers across iterations too).

use super::model::{err, Elem, GStash};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice};
use pipec_runtime::backend::BackendError;
use std::collections::HashMap;
use std::sync::Arc;

/// A stash in host memory: one pinned buffer per device buffer of its [`GStash`].
pub enum HStash<T> {
    Embedding {
        tokens: PinnedHostSlice<u32>,
        step: u32,
        mb: u32,
    },
    /// As [`GStash`]'s: what the input gradient alone reads is gone once it ran.
    Block {
        x: PinnedHostSlice<T>,
        h: Option<PinnedHostSlice<T>>,
        a: PinnedHostSlice<T>,
    },
    Head {
        x: PinnedHostSlice<T>,
        probs: Option<PinnedHostSlice<T>>,
        targets: Option<PinnedHostSlice<u32>>,
    },
}

/// Free page-locked buffers of one element type, by length.
struct Pool<U> {
    free: HashMap<usize, Vec<PinnedHostSlice<U>>>,
}

impl<U: DeviceRepr> Pool<U> {
    fn new() -> Self {
        Pool {
            free: HashMap::new(),
        }
    }

    /// Copy `d` into a pinned buffer on `copy` (device to host).
    fn down(
        &mut self,
        ctx: &Arc<CudaContext>,
        copy: &Arc<CudaStream>,
        d: &CudaSlice<U>,
    ) -> Result<PinnedHostSlice<U>, BackendError> {
        let mut h = match self.free.get_mut(&d.len()).and_then(Vec::pop) {
            Some(h) => h,
            // SAFETY: the buffer is uninitialized; the copy below fills all of it before
            // anything reads it (the reload's copy, ordered after it on the same stream).
            // Flags 0: plain page-locked memory (write-combined memory is slow to read back).
            None => unsafe { ctx.alloc_pinned_with_flags::<U>(d.len(), 0) }
                .map_err(err("allocate page-locked host memory (cuMemHostAlloc)"))?,
        };
        copy.memcpy_dtoh(d, &mut h)
            .map_err(err("copy activations to the host (offload)"))?;
        Ok(h)
    }

    /// Copy `h` into `d` on `copy` (host to device) and keep `h` for a later offload: cudarc
    /// orders its next use after this copy (the pinned buffer's event).
    fn up(
        &mut self,
        copy: &Arc<CudaStream>,
        h: PinnedHostSlice<U>,
        d: &mut CudaSlice<U>,
    ) -> Result<(), BackendError> {
        copy.memcpy_htod(&h, d)
            .map_err(err("copy activations back to the device (reload)"))?;
        self.give(h);
        Ok(())
    }

    fn give(&mut self, h: PinnedHostSlice<U>) {
        self.free.entry(h.len()).or_default().push(h);
    }
}

/// The pinned buffers of one rank.
pub struct Pinned<T> {
    ctx: Arc<CudaContext>,
    t: Pool<T>,
    u: Pool<u32>,
}

impl<T: Elem> Pinned<T> {
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        Pinned {
            ctx,
            t: Pool::new(),
            u: Pool::new(),
        }
    }

    /// Post the device-to-host copies of `stash` on `copy`; the device buffers must stay
    /// allocated until they have ended (the caller keeps them).
    pub fn offload(
        &mut self,
        copy: &Arc<CudaStream>,
        stash: &[GStash<T>],
    ) -> Result<Vec<HStash<T>>, BackendError> {
        let ctx = &self.ctx;
        stash
            .iter()
            .map(|s| {
                Ok(match s {
                    GStash::Embedding { tokens, step, mb } => HStash::Embedding {
                        tokens: self.u.down(ctx, copy, tokens)?,
                        step: *step,
                        mb: *mb,
                    },
                    GStash::Block { x, h, a } => HStash::Block {
                        x: self.t.down(ctx, copy, x)?,
                        h: h.as_ref().map(|h| self.t.down(ctx, copy, h)).transpose()?,
                        a: self.t.down(ctx, copy, a)?,
                    },
                    GStash::Head { x, probs, targets } => HStash::Head {
                        x: self.t.down(ctx, copy, x)?,
                        probs: probs
                            .as_ref()
                            .map(|p| self.t.down(ctx, copy, p))
                            .transpose()?,
                        targets: targets
                            .as_ref()
                            .map(|t| self.u.down(ctx, copy, t))
                            .transpose()?,
                    },
                })
            })
            .collect()
    }

    /// Device buffers shaped as `host`, allocated on `stream` (the compute stream: the reload's
    /// buffer counts from the reload's position, PipeOffload's `OFFLOAD_RECV_PREP`, and is
    /// freed there after the backward).
    pub fn alloc_like(
        stream: &Arc<CudaStream>,
        host: &[HStash<T>],
    ) -> Result<Vec<GStash<T>>, BackendError> {
        fn z<U: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
            s: &Arc<CudaStream>,
            n: usize,
        ) -> Result<CudaSlice<U>, BackendError> {
            s.alloc_zeros::<U>(n)
                .map_err(err("allocate device memory for a reload"))
        }
        host.iter()
            .map(|h| {
                Ok(match h {
                    HStash::Embedding { tokens, step, mb } => GStash::Embedding {
                        tokens: z(stream, tokens.len())?,
                        step: *step,
                        mb: *mb,
                    },
                    HStash::Block { x, h, a } => GStash::Block {
                        x: z(stream, x.len())?,
                        h: h.as_ref().map(|h| z(stream, h.len())).transpose()?,
                        a: z(stream, a.len())?,
                    },
                    HStash::Head { x, probs, targets } => GStash::Head {
                        x: z(stream, x.len())?,
                        probs: probs.as_ref().map(|p| z(stream, p.len())).transpose()?,
                        targets: targets.as_ref().map(|t| z(stream, t.len())).transpose()?,
                    },
                })
            })
            .collect()
    }

    /// Give the buffers of `host` back to the pool (once no copy into them is pending: cudarc
    /// orders a later copy after the last one anyway, through each buffer's event).
    pub fn recycle(&mut self, host: Vec<HStash<T>>) {
        for h in host {
            match h {
                HStash::Embedding { tokens, .. } => self.u.give(tokens),
                HStash::Block { x, h, a } => {
                    self.t.give(x);
                    h.into_iter().for_each(|h| self.t.give(h));
                    self.t.give(a);
                }
                HStash::Head { x, probs, targets } => {
                    self.t.give(x);
                    probs.into_iter().for_each(|p| self.t.give(p));
                    targets.into_iter().for_each(|t| self.u.give(t));
                }
            }
        }
    }

    /// Post the host-to-device copies of `host` into `dev` (from [`Self::alloc_like`]) on
    /// `copy`; the host buffers go back to the pool.
    pub fn reload(
        &mut self,
        copy: &Arc<CudaStream>,
        host: Vec<HStash<T>>,
        dev: &mut [GStash<T>],
    ) -> Result<(), BackendError> {
        for (h, d) in host.into_iter().zip(dev.iter_mut()) {
            match (h, d) {
                (HStash::Embedding { tokens, .. }, GStash::Embedding { tokens: dt, .. }) => {
                    self.u.up(copy, tokens, dt)?
                }
                (
                    HStash::Block { x, h, a },
                    GStash::Block {
                        x: dx,
                        h: dh,
                        a: da,
                    },
                ) => {
                    self.t.up(copy, x, dx)?;
                    if let (Some(h), Some(dh)) = (h, dh) {
                        self.t.up(copy, h, dh)?;
                    }
                    self.t.up(copy, a, da)?;
                }
                (
                    HStash::Head { x, probs, targets },
                    GStash::Head {
                        x: dx,
                        probs: dp,
                        targets: dt,
                    },
                ) => {
                    self.t.up(copy, x, dx)?;
                    if let (Some(p), Some(dp)) = (probs, dp) {
                        self.t.up(copy, p, dp)?;
                    }
                    if let (Some(t), Some(dt)) = (targets, dt) {
                        self.u.up(copy, t, dt)?;
                    }
                }
                _ => {
                    return Err(BackendError(
                        "a reload's device buffers do not match its host stash".into(),
                    ))
                }
            }
        }
        Ok(())
    }
}

//! Global instruction ids and the optional index the dense tables hold.

use super::{InstrRef, Program};
use pipec_schedules::Rank;

/// An index into a dense table, or none: a `u32` whose `u32::MAX` means "none". Half the size
/// of `Option<u32>`, which matters in tables with one entry per instruction of a size-L
/// program (millions).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct OptIdx(u32);

impl OptIdx {
    pub const NONE: OptIdx = OptIdx(u32::MAX);

    /// `Some(i)` for `i < u32::MAX`; callers number at most `u32::MAX - 1` things (see
    /// [`Positions::new`]).
    #[inline]
    pub fn some(i: u32) -> OptIdx {
        debug_assert!(i != u32::MAX);
        OptIdx(i)
    }

    #[inline]
    pub fn get(self) -> Option<u32> {
        (self.0 != u32::MAX).then_some(self.0)
    }

    #[inline]
    pub fn is_some(self) -> bool {
        self.0 != u32::MAX
    }

    #[inline]
    pub fn is_none(self) -> bool {
        self.0 == u32::MAX
    }
}

impl Default for OptIdx {
    fn default() -> Self {
        OptIdx::NONE
    }
}

impl From<Option<u32>> for OptIdx {
    fn from(o: Option<u32>) -> Self {
        o.map_or(OptIdx::NONE, OptIdx::some)
    }
}

/// Global instruction ids: the ranks' streams concatenated in rank order, so one dense table
/// can hold a value per instruction of the whole program.
#[derive(Clone, Debug)]
pub struct Positions {
    /// Global id of each rank's instruction 0; `world + 1` entries, the last the total.
    offsets: Vec<u32>,
}

/// A program with `u32::MAX` or more instructions (or ranks) cannot be numbered with `u32`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TooLarge {
    pub instructions: u64,
}

impl Positions {
    pub fn new(p: &Program) -> Result<Positions, TooLarge> {
        let total: u64 = p.ranks.iter().map(|r| r.len() as u64).sum();
        if total >= u32::MAX as u64 || p.ranks.len() as u64 >= u32::MAX as u64 {
            return Err(TooLarge {
                instructions: total,
            });
        }
        let mut offsets = Vec::with_capacity(p.ranks.len() + 1);
        let mut acc = 0u32;
        for r in &p.ranks {
            offsets.push(acc);
            acc += r.len() as u32;
        }
        offsets.push(acc);
        Ok(Positions { offsets })
    }

    /// Number of instructions.
    #[inline]
    pub fn total(&self) -> u32 {
        *self.offsets.last().unwrap_or(&0)
    }

    /// Global id of rank `r`'s instruction 0.
    #[inline]
    pub fn base(&self, r: usize) -> u32 {
        self.offsets[r]
    }

    /// Global ids of rank `r`'s instructions.
    #[inline]
    pub fn range(&self, r: usize) -> std::ops::Range<u32> {
        self.offsets[r]..self.offsets[r + 1]
    }

    /// The global id of `at`, `None` when it names no instruction.
    pub fn global(&self, at: InstrRef) -> Option<u32> {
        let r = at.rank.index();
        let base = *self.offsets.get(r)?;
        let g = base.checked_add(at.index)?;
        (g < *self.offsets.get(r + 1)?).then_some(g)
    }

    /// The rank holding global id `g` (a binary search; empty ranks are skipped).
    #[inline]
    pub fn rank_of(&self, g: u32) -> u32 {
        (self.offsets.partition_point(|&o| o <= g) - 1) as u32
    }

    /// Whether global id `g` is on rank `r`.
    #[inline]
    pub fn on_rank(&self, g: u32, r: u32) -> bool {
        g >= self.offsets[r as usize] && g < self.offsets[r as usize + 1]
    }

    /// Rank and index of global id `g`.
    pub fn local(&self, g: u32) -> InstrRef {
        let r = self.rank_of(g);
        InstrRef {
            rank: Rank(r),
            index: g - self.offsets[r as usize],
        }
    }
}

//! Dense integer ids. Newtypes so a stage can never be passed where a rank is expected.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! id {
    ($(#[$m:meta])* $name:ident, $word:literal) => {
        $(#[$m])*
        #[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub u32);

        impl $name {
            /// The id as an index into dense tables.
            #[inline]
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($word, " {}"), self.0)
            }
        }
    };
}

id!(
    /// A global virtual stage, `0..S` in model order.
    StageId,
    "stage"
);
id!(
    /// A microbatch, `0..M`.
    Microbatch,
    "mb"
);
id!(
    /// A pipeline-parallel rank, `0..pp`.
    Rank,
    "rank"
);

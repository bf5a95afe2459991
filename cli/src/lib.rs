//! What the `pipec` and `pipec-run` binaries share. Everything else of the command lines lives
//! beside each binary (`src/bin/pipec/cli/`, `src/bin/pipec-run/`); the work is in the
//! libraries (`pipec`, `pipec-runtime`), which know no flag names.

pub mod sigpipe;

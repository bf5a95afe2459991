//! `--ranks`, `--from`, `--to`: the part of a timeline `show` draws and `export` writes.

use super::CliError;

#[derive(clap::Args, Debug, Default)]
pub struct WindowArgs {
    /// Ranks to keep, e.g. "0,3-5" (default: all).
    #[arg(long, value_name = "LIST")]
    pub ranks: Option<String>,
    /// Start of the time window, in cost units: ops that end at or after it (default: 0).
    #[arg(long, value_name = "T")]
    pub from: Option<f64>,
    /// End of the time window, in cost units: ops that start at or before it (default: the
    /// end).
    #[arg(long, value_name = "T")]
    pub to: Option<f64>,
}

impl WindowArgs {
    /// Times finite, not negative, `--from` before `--to`.
    pub fn check(&self) -> Result<(), CliError> {
        for (flag, v) in [("--from", self.from), ("--to", self.to)] {
            if v.is_some_and(|v| !(v.is_finite() && v >= 0.0)) {
                return Err(CliError::Usage(format!(
                    "{flag} must be a finite time >= 0"
                )));
            }
        }
        if let (Some(f), Some(t)) = (self.from, self.to) {
            if f >= t {
                return Err(CliError::Usage(format!(
                    "--from {f} must be before --to {t}"
                )));
            }
        }
        Ok(())
    }

    /// The ranks asked for among `world`, `None` for all.
    pub fn ranks(&self, world: usize) -> Result<Option<Vec<usize>>, CliError> {
        self.ranks
            .as_deref()
            .map(|r| super::show::parse_ranks(r, world))
            .transpose()
    }

    /// Whether any of the three was given.
    pub fn any(&self) -> bool {
        self.ranks.is_some() || self.from.is_some() || self.to.is_some()
    }
}

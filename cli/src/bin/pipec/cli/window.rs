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
            .map(|r| parse_ranks(r, world))
            .transpose()
    }

    /// Whether any of the three was given.
    pub fn any(&self) -> bool {
        self.ranks.is_some() || self.from.is_some() || self.to.is_some()
    }
}

/// Parse `0,3-5` into rank numbers (in the order given), each below `world`.
pub fn parse_ranks(text: &str, world: usize) -> Result<Vec<usize>, CliError> {
    let bad = |why: String| CliError::Usage(format!("--ranks {text:?}: {why}"));
    let mut out = Vec::new();
    for part in text.split(',') {
        let part = part.trim();
        let num = |s: &str| {
            s.trim()
                .parse::<usize>()
                .map_err(|_| bad(format!("{s:?} is not a rank number")))
        };
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(part)?, num(part)?),
        };
        if a > b {
            return Err(bad(format!("{a}-{b} is an empty range")));
        }
        if b >= world {
            return Err(bad(format!("rank {b} does not exist ({world} ranks)")));
        }
        out.extend(a..=b);
    }
    Ok(out)
}

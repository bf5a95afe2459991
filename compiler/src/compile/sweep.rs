//! Many schedules in one call: the configuration file of `pipec compile --config FILE`.
//!
//! Precompiling in CI means compiling, verifying and writing many configurations at once. A
//! sweep file (TOML) lists schedules explicitly, grids over kinds / pp / vpp / microbatches,
//! or both:
//!
//! ```toml
//! [[schedule]]
//! name = "dsv3"                       # optional; default <kind>-pp<P>-vpp<V>-m<M>
//! schedule = "interleaved-1f1b"
//! pp = 16
//! microbatches = 32
//! layout = "Et*3|(tt|)*29,m|L"        # optional; vpp then comes from the layout
//!
//! [[grid]]
//! schedule = ["1f1b", "interleaved-1f1b"]
//! pp = [4, 8]
//! vpp = [2, 4]                        # applies to kinds that take chunks; others use 1
//! microbatches = [16, 32]
//! ```
//!
//! Expansion is pure and bounded: the number of configurations is computed before anything
//! is allocated for them, and refused above [`MAX_CONFIGS`].

use super::CompileRequest;
use pipec_schedules::{ChunkRule, Limits, ScheduleKind};
use serde::Deserialize;
use thiserror::Error;

/// Most configurations one sweep file may expand to.
pub const MAX_CONFIGS: u64 = 10_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SweepFile {
    #[serde(default)]
    schedule: Vec<Entry>,
    #[serde(default)]
    grid: Vec<Grid>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: Option<String>,
    schedule: String,
    pp: u32,
    vpp: Option<u32>,
    microbatches: u32,
    group_size: Option<u32>,
    layout: Option<String>,
    #[serde(default)]
    forward_only: bool,
    memory_limit: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Grid {
    schedule: Vec<String>,
    pp: Vec<u32>,
    #[serde(default = "one")]
    vpp: Vec<u32>,
    microbatches: Vec<u32>,
    #[serde(default)]
    forward_only: bool,
    memory_limit: Option<u64>,
}

fn one() -> Vec<u32> {
    vec![1]
}

/// One configuration of a sweep.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Directory name under the output directory.
    pub name: String,
    pub request: CompileRequest,
    pub memory_limit: Option<u64>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SweepError {
    #[error("{0}")]
    Toml(String),
    #[error("{entry}: {msg}")]
    Entry { entry: String, msg: String },
    #[error("the sweep expands to {count} configurations, over the limit of {MAX_CONFIGS}")]
    TooMany { count: u64 },
    #[error("the sweep has no configurations (add [[schedule]] or [[grid]] tables)")]
    Empty,
    #[error("two configurations are both named `{0}`; give one a different `name`")]
    DuplicateName(String),
    #[error("`{0}` is not a usable directory name (letters, digits, `.`, `_`, `-` only)")]
    BadName(String),
}

fn kind(entry: &str, s: &str) -> Result<ScheduleKind, SweepError> {
    s.parse()
        .map_err(|e: pipec_schedules::UnknownKind| SweepError::Entry {
            entry: entry.to_string(),
            msg: e.to_string(),
        })
}

fn default_name(k: ScheduleKind, pp: u32, vpp: Option<u32>, m: u32) -> String {
    format!("{}-pp{pp}-vpp{}-m{m}", k.name(), vpp.unwrap_or(1))
}

/// Parse and expand a sweep file. `limits` applies to every configuration.
pub fn parse(text: &str, limits: Limits) -> Result<Vec<Config>, SweepError> {
    let file: SweepFile = toml::from_str(text).map_err(|e| SweepError::Toml(e.to_string()))?;
    let mut count = file.schedule.len() as u64;
    for g in &file.grid {
        let n = [
            g.schedule.len(),
            g.pp.len(),
            g.vpp.len(),
            g.microbatches.len(),
        ]
        .iter()
        .fold(1u64, |acc, &x| acc.saturating_mul(x as u64));
        count = count.saturating_add(n);
    }
    if count > MAX_CONFIGS {
        return Err(SweepError::TooMany { count });
    }
    let mut out = Vec::with_capacity(count as usize);
    for (i, e) in file.schedule.into_iter().enumerate() {
        let label = format!("[[schedule]] #{}", i + 1);
        let k = kind(&label, &e.schedule)?;
        out.push(Config {
            name: e
                .name
                .unwrap_or_else(|| default_name(k, e.pp, e.vpp, e.microbatches)),
            request: CompileRequest {
                vpp: e.vpp,
                group_size: e.group_size,
                forward_only: e.forward_only,
                layout: e.layout,
                limits,
                ..CompileRequest::new(k, e.pp, e.microbatches)
            },
            memory_limit: e.memory_limit,
        });
    }
    for (i, g) in file.grid.iter().enumerate() {
        let label = format!("[[grid]] #{}", i + 1);
        for s in &g.schedule {
            let k = kind(&label, s)?;
            // vpp values apply to kinds that take any chunk count; the V kinds run exactly 2,
            // the others one chunk per rank.
            let vpps: Vec<u32> = match k.chunk_rule() {
                ChunkRule::Any => g.vpp.clone(),
                rule => vec![if rule == ChunkRule::TwoV { 2 } else { 1 }],
            };
            for &pp in &g.pp {
                for &vpp in &vpps {
                    for &m in &g.microbatches {
                        out.push(Config {
                            name: default_name(k, pp, Some(vpp), m),
                            request: CompileRequest {
                                vpp: Some(vpp),
                                forward_only: g.forward_only,
                                limits,
                                ..CompileRequest::new(k, pp, m)
                            },
                            memory_limit: g.memory_limit,
                        });
                    }
                }
            }
        }
    }
    if out.is_empty() {
        return Err(SweepError::Empty);
    }
    // A grid may repeat a configuration (vpp of single-chunk kinds): keep the first.
    let mut seen = std::collections::HashSet::new();
    let mut unique = Vec::with_capacity(out.len());
    for c in out {
        let ok = !c.name.is_empty()
            && c.name
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '-'))
            && c.name != "."
            && c.name != "..";
        if !ok {
            return Err(SweepError::BadName(c.name));
        }
        if !seen.insert(c.name.clone()) {
            if unique.iter().any(|u: &Config| u == &c) {
                continue;
            }
            return Err(SweepError::DuplicateName(c.name));
        }
        unique.push(c);
    }
    Ok(unique)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_and_entries_expand_in_order() {
        let text = r#"
            [[schedule]]
            name = "dsv3"
            schedule = "interleaved-1f1b"
            pp = 16
            microbatches = 32
            layout = "Et*3|(tt|)*29,m|L"

            [[grid]]
            schedule = ["1f1b", "interleaved-1f1b"]
            pp = [2, 4]
            vpp = [2, 3]
            microbatches = [8]
        "#;
        let c = parse(text, Limits::DEFAULT).unwrap();
        let names: Vec<&str> = c.iter().map(|c| c.name.as_str()).collect();
        // 1f1b ignores the vpp axis (one config per pp), interleaved takes both values.
        assert_eq!(
            names,
            vec![
                "dsv3",
                "1f1b-pp2-vpp1-m8",
                "1f1b-pp4-vpp1-m8",
                "interleaved-1f1b-pp2-vpp2-m8",
                "interleaved-1f1b-pp2-vpp3-m8",
                "interleaved-1f1b-pp4-vpp2-m8",
                "interleaved-1f1b-pp4-vpp3-m8",
            ]
        );
        assert_eq!(c[0].request.layout.as_deref(), Some("Et*3|(tt|)*29,m|L"));
        assert_eq!(c[0].request.vpp, None);
    }

    #[test]
    fn errors_are_named() {
        let l = Limits::DEFAULT;
        assert!(matches!(parse("", l), Err(SweepError::Empty)));
        assert!(matches!(
            parse("[[grid]]\nschedule = [\"zz\"]\npp=[1]\nmicrobatches=[1]", l),
            Err(SweepError::Entry { .. })
        ));
        assert!(matches!(parse("bogus = 1", l), Err(SweepError::Toml(_))));
        let huge = "[[grid]]\nschedule=[\"1f1b\"]\npp=[1,2,3,4,5,6,7,8,9,10]\nmicrobatches=[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63,64,65,66,67,68,69,70,71,72,73,74,75,76,77,78,79,80,81,82,83,84,85,86,87,88,89,90,91,92,93,94,95,96,97,98,99,100]\n";
        assert!(parse(huge, l).is_ok());
        let twice = "[[schedule]]\nname=\"a\"\nschedule=\"1f1b\"\npp=2\nmicrobatches=2\n[[schedule]]\nname=\"a\"\nschedule=\"gpipe\"\npp=2\nmicrobatches=2\n";
        assert_eq!(parse(twice, l), Err(SweepError::DuplicateName("a".into())));
        let bad = "[[schedule]]\nname=\"../x\"\nschedule=\"1f1b\"\npp=2\nmicrobatches=2\n";
        assert_eq!(parse(bad, l), Err(SweepError::BadName("../x".into())));
    }
}

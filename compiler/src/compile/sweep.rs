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
//! vpp = [2, 4]                        # required for kinds that take chunks; others use 1
//! microbatches = [16, 32]
//! megatron_p2p = "unbatched"          # optional, 1f1b and interleaved-1f1b only
//! combined = true                     # optional, likewise
//! num_layers = 32                     # optional (also mtp_num_layers)
//! p2p_groups = "edge"                 # optional: pair (default), direction, edge
//! buffer_plan = true                  # optional
//! ```
//!
//! `megatron_p2p`, `combined`, `num_layers`, `mtp_num_layers`, `p2p_groups` and
//! `buffer_plan` mean what `pipec compile`'s flags of the same names do; a default name gains a
//! suffix for each (`-combined`, `-unbatched`, `-l32`, `-mtp1`, `-edge`, `-slots`) so that
//! variants never share a directory.
//!
//! Expansion is pure and bounded: the number of configurations is computed before anything
//! is allocated for them, and refused above [`MAX_CONFIGS`].

use super::CompileRequest;
use pipec_schedules::{ChunkRule, Limits, MegatronP2p, P2pGroups, ScheduleKind};
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
    // As `pipec compile`'s flags of the same names; in a grid, the Megatron options apply to
    // the kinds that take them (1f1b, interleaved-1f1b), as vpp does.
    megatron_p2p: Option<String>,
    #[serde(default)]
    combined: bool,
    num_layers: Option<u32>,
    mtp_num_layers: Option<u32>,
    p2p_groups: Option<String>,
    #[serde(default)]
    buffer_plan: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Grid {
    schedule: Vec<String>,
    pp: Vec<u32>,
    /// Required when a listed kind takes any chunk count (no silent vpp = 1).
    #[serde(default)]
    vpp: Vec<u32>,
    microbatches: Vec<u32>,
    #[serde(default)]
    forward_only: bool,
    memory_limit: Option<u64>,
    // As `pipec compile`'s flags of the same names; in a grid, the Megatron options apply to
    // the kinds that take them (1f1b, interleaved-1f1b), as vpp does.
    megatron_p2p: Option<String>,
    #[serde(default)]
    combined: bool,
    num_layers: Option<u32>,
    mtp_num_layers: Option<u32>,
    p2p_groups: Option<String>,
    #[serde(default)]
    buffer_plan: bool,
}

fn groups(entry: &str, s: Option<&str>) -> Result<P2pGroups, SweepError> {
    s.map_or(Ok(P2pGroups::Pair), |s| {
        s.parse().map_err(|msg| SweepError::Entry {
            entry: entry.to_string(),
            msg,
        })
    })
}

fn p2p(entry: &str, s: &str) -> Result<MegatronP2p, SweepError> {
    s.parse().map_err(|msg| SweepError::Entry {
        entry: entry.to_string(),
        msg,
    })
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

/// `<kind>-pp<P>-vpp<V>-m<M>`, `V` the chunks the schedule runs: the kind's own count when the
/// entry gives none (2 for the V kinds, as a grid names them), not 1.
fn default_name(k: ScheduleKind, pp: u32, vpp: Option<u32>, m: u32) -> String {
    format!(
        "{}-pp{pp}-vpp{}-m{m}",
        k.name(),
        vpp.unwrap_or(k.default_vpp())
    )
}

/// The default name, with a suffix for each option that makes the schedule differ from the
/// kind's default, so a grid over them names every configuration apart.
fn variant_name(base: String, r: &CompileRequest) -> String {
    let mut name = base;
    if r.combined {
        name.push_str("-combined");
    }
    if r.megatron_p2p != MegatronP2p::default_for(r.kind, r.pp) {
        name.push_str(&format!("-{}", r.megatron_p2p));
    }
    if let Some(n) = r.num_layers {
        name.push_str(&format!("-l{n}"));
    }
    if let Some(n) = r.mtp_num_layers {
        name.push_str(&format!("-mtp{n}"));
    }
    if r.p2p_groups != P2pGroups::Pair {
        name.push_str(&format!("-{}", r.p2p_groups));
    }
    if r.buffer_plan {
        name.push_str("-slots");
    }
    name
}

/// Parse and expand a sweep file. `limits` applies to every configuration.
pub fn parse(text: &str, limits: Limits) -> Result<Vec<Config>, SweepError> {
    let file: SweepFile = toml::from_str(text).map_err(|e| SweepError::Toml(e.to_string()))?;
    let mut count = file.schedule.len() as u64;
    for g in &file.grid {
        let n = [
            g.schedule.len(),
            g.pp.len(),
            // Kinds with a fixed chunk count take one vpp whatever the list (an upper bound).
            g.vpp.len().max(1),
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
        let base = CompileRequest::new(k, e.pp, e.microbatches);
        let request = CompileRequest {
            vpp: e.vpp,
            group_size: e.group_size,
            forward_only: e.forward_only,
            layout: e.layout,
            combined: e.combined,
            megatron_p2p: match &e.megatron_p2p {
                Some(m) => p2p(&label, m)?,
                None => base.megatron_p2p,
            },
            num_layers: e.num_layers,
            mtp_num_layers: e.mtp_num_layers,
            p2p_groups: groups(&label, e.p2p_groups.as_deref())?,
            buffer_plan: e.buffer_plan,
            limits,
            ..base
        };
        out.push(Config {
            name: e.name.unwrap_or_else(|| {
                variant_name(default_name(k, e.pp, e.vpp, e.microbatches), &request)
            }),
            request,
            memory_limit: e.memory_limit,
        });
    }
    for (i, g) in file.grid.iter().enumerate() {
        let label = format!("[[grid]] #{}", i + 1);
        let comms = groups(&label, g.p2p_groups.as_deref())?;
        let mode = g
            .megatron_p2p
            .as_deref()
            .map(|m| p2p(&label, m))
            .transpose()?;
        for s in &g.schedule {
            let k = kind(&label, s)?;
            // vpp values apply to kinds that take any chunk count; the V kinds run exactly 2,
            // the others one chunk per rank.
            let vpps: Vec<u32> = match k.chunk_rule() {
                ChunkRule::Any if g.vpp.is_empty() => {
                    return Err(SweepError::Entry {
                        entry: label,
                        msg: format!(
                            "{k} takes several model chunks per rank: give `vpp = [...]` (vpp = [1] for one chunk)"
                        ),
                    })
                }
                ChunkRule::Any => g.vpp.clone(),
                rule => vec![if rule == ChunkRule::TwoV { 2 } else { 1 }],
            };
            for &pp in &g.pp {
                for &vpp in &vpps {
                    for &m in &g.microbatches {
                        let base = CompileRequest::new(k, pp, m);
                        // Megatron's options go to its two loops (the kinds that take both).
                        let request = CompileRequest {
                            vpp: Some(vpp),
                            forward_only: g.forward_only,
                            combined: g.combined && k.supports_combined(),
                            megatron_p2p: match mode {
                                Some(m) if k.supports_combined() => m,
                                _ => base.megatron_p2p,
                            },
                            num_layers: g.num_layers,
                            mtp_num_layers: g.mtp_num_layers,
                            p2p_groups: comms,
                            buffer_plan: g.buffer_plan,
                            limits,
                            ..base
                        };
                        out.push(Config {
                            name: variant_name(default_name(k, pp, Some(vpp), m), &request),
                            request,
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

    /// Regression (#29): the sweep file could not set `megatron_p2p`, `combined`,
    /// `num_layers`.
    #[test]
    fn sweep_sets_p2p_combined_and_layers() {
        let text = r#"
            [[schedule]]
            schedule = "interleaved-1f1b"
            pp = 4
            vpp = 2
            microbatches = 8
            megatron_p2p = "overlap"
            combined = true
            num_layers = 16

            [[grid]]
            schedule = ["1f1b", "gpipe"]
            pp = [2]
            microbatches = [4]
            megatron_p2p = "unbatched"
            combined = true
            num_layers = 4
            mtp_num_layers = 1
        "#;
        let c = parse(text, Limits::DEFAULT).unwrap();
        let names: Vec<&str> = c.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "interleaved-1f1b-pp4-vpp2-m8-combined-overlap-l16",
                "1f1b-pp2-vpp1-m4-combined-unbatched-l4-mtp1",
                "gpipe-pp2-vpp1-m4-l4-mtp1",
            ]
        );
        let r = &c[0].request;
        assert_eq!(
            (r.megatron_p2p, r.combined, r.num_layers),
            (MegatronP2p::Overlap, true, Some(16))
        );
        let r = &c[1].request;
        assert_eq!((r.megatron_p2p, r.combined), (MegatronP2p::Unbatched, true));
        // gpipe takes neither Megatron option: it keeps its defaults, as vpp does.
        let r = &c[2].request;
        assert_eq!(
            (r.megatron_p2p, r.combined, r.mtp_num_layers),
            (MegatronP2p::Batched, false, Some(1))
        );
        // Every configuration compiles.
        for cfg in &c {
            crate::compile::compile(&cfg.request).unwrap();
        }
        let bad = "[[schedule]]\nschedule=\"1f1b\"\npp=2\nmicrobatches=2\nmegatron_p2p=\"fast\"\n";
        assert!(matches!(
            parse(bad, Limits::DEFAULT),
            Err(SweepError::Entry { .. })
        ));
    }

    /// Issue #39's options in a sweep: `p2p_groups` and `buffer_plan` reach the request and the
    /// program, name their variants apart, and a bad group is refused naming its entry.
    #[test]
    fn sweep_sets_groups_and_buffer_plan() {
        let text = r#"
            [[schedule]]
            schedule = "zb-v"
            pp = 2
            microbatches = 4
            p2p_groups = "edge"
            buffer_plan = true

            [[grid]]
            schedule = ["1f1b"]
            pp = [2]
            microbatches = [4]
            p2p_groups = "direction"
        "#;
        let c = parse(text, Limits::DEFAULT).unwrap();
        let names: Vec<&str> = c.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            vec!["zb-v-pp2-vpp2-m4-edge-slots", "1f1b-pp2-vpp1-m4-direction"]
        );
        let model = pipec_cost::cost::CostModel::default();
        let p = crate::compile::prepare(&c[0].request, &model, None).unwrap();
        assert_eq!(p.program.p2p_groups, P2pGroups::Edge);
        assert!(p.program.buffer_slots.is_some());
        let p = crate::compile::prepare(&c[1].request, &model, None).unwrap();
        assert_eq!(p.program.p2p_groups, P2pGroups::Direction);
        assert!(p.program.buffer_slots.is_none());
        let bad = "[[schedule]]\nschedule=\"1f1b\"\npp=2\nmicrobatches=2\np2p_groups=\"ring\"\n";
        let e = parse(bad, Limits::DEFAULT).unwrap_err();
        assert!(matches!(e, SweepError::Entry { .. }), "{e}");
        assert!(e.to_string().contains("ring"), "{e}");
    }

    /// Regression (#29): a grid listing interleaved-1f1b without `vpp` ran vpp = 1.
    #[test]
    fn grid_of_chunked_kinds_needs_vpp() {
        let text = "[[grid]]\nschedule=[\"interleaved-1f1b\"]\npp=[2]\nmicrobatches=[4]\n";
        let e = parse(text, Limits::DEFAULT).unwrap_err();
        assert!(e.to_string().contains("give `vpp = [...]`"), "{e}");
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

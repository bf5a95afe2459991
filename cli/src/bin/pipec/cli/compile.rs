//! `pipec compile`: generate, lower, verify, write. With `--config FILE`, many schedules at
//! once (see [`pipec_compiler::compile::sweep`]), on all cores, with a summary table.

use super::CliError;
use pipec_compiler::compile::sweep;
use pipec_compiler::compile::{prepare, BuildError, CompileError, CompileRequest};
use pipec_cost::cost::CostModel;
use pipec_cost::memory::Limit;
use pipec_ir::files::{self, Header};
use pipec_ir::verify::Unverified;
use pipec_schedules::{Limits, MegatronP2p, ScheduleKind, SpecError};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Schedule kind (see `pipec schedules`).
    #[arg(long, value_parser = parse_kind, required_unless_present = "config")]
    pub schedule: Option<ScheduleKind>,
    /// Pipeline-parallel size (ranks).
    #[arg(long, required_unless_present = "config")]
    pub pp: Option<u32>,
    /// Model chunks per rank; derived from --layout when one is given.
    #[arg(long)]
    pub vpp: Option<u32>,
    /// Number of microbatches (may be left out with --microbatch-lengths).
    #[arg(long, required_unless_present_any = ["config", "microbatch_lengths"])]
    pub microbatches: Option<u32>,
    #[command(flatten)]
    pub lengths: super::args::LengthsArgs,
    /// The order microbatches enter the pipeline, comma separated (e.g. 2,0,3,1: the
    /// schedule's first microbatch is your microbatch 2); the rank files keep your ids. What
    /// `pipec tune --json` reports as `microbatch_order`. Default: index order.
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub microbatch_order: Option<Vec<u32>>,
    /// A sweep file (TOML) of many schedules: each is compiled, verified and written to
    /// OUT/<name>/; a summary table follows. See the README's "Sweeps" section.
    #[arg(long, conflicts_with_all = ["schedule", "pp", "vpp", "microbatches", "layout", "layout_file", "group_size", "forward_only", "num_layers", "mtp_num_layers", "megatron_partial_recompute", "microbatch_lengths", "megatron_variable_seq_lengths"])]
    pub config: Option<PathBuf>,
    /// Megatron layout string, e.g. "Et*3|(tt|)*29,m|L".
    #[arg(long, conflicts_with = "layout_file")]
    pub layout: Option<String>,
    /// Read the layout string from a file (one trailing newline is ignored).
    #[arg(long, value_name = "FILE")]
    pub layout_file: Option<PathBuf>,
    /// Microbatches per group (default pp): Megatron's microbatch_group_size_per_vp_stage for
    /// interleaved-1f1b (pp <= g <= M), PipeOffload's interleave group size for
    /// group-interleaved (1 <= g <= pp).
    #[arg(long)]
    pub group_size: Option<u32>,
    /// Inference: forwards only.
    #[arg(long)]
    pub forward_only: bool,
    /// Megatron's combined 1F1B (1f1b, interleaved-1f1b): one more warmup microbatch, each
    /// steady forward/backward pair one overlapped fwd_bwd op.
    #[arg(long)]
    pub combined: bool,
    /// How Megatron posts its P2P calls (1f1b, interleaved-1f1b): batched (megatron-core's
    /// default, batch_p2p_comm), unbatched, overlap (overlap_p2p_comm with
    /// deallocate_pipeline_outputs, Megatron-LM's training default for interleaving),
    /// overlap-flush (plus overlap_p2p_comm_warmup_flush), overlap-keep-outputs and
    /// overlap-flush-keep-outputs (deallocate_pipeline_outputs off).
    /// Default: batched, or overlap for interleaved-1f1b at pp = 2 (the only mode Megatron
    /// runs there).
    #[arg(long, value_parser = parse_p2p)]
    pub megatron_p2p: Option<MegatronP2p>,
    /// Megatron's num_microbatches_with_partial_activation_checkpoints (1f1b,
    /// interleaved-1f1b): the forwards megatron-core checkpoints fully (on rank r, the k-th
    /// forward when k mod (warmup_r + 1) >= N) are written with "checkpoint": true and a
    /// recompute before their backward; the order of everything else is unchanged.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub megatron_partial_recompute: Option<i64>,
    /// Model Megatron's config.variable_seq_lengths=True (1f1b, interleaved-1f1b): before
    /// every P2P call, the shape messages megatron-core's _communicate_shapes posts (one
    /// batch_isend_irecv in [send_prev, recv_prev, send_next, recv_next] order, whatever
    /// --megatron-p2p, then torch.cuda.synchronize()), as act_shape / grad_shape messages. The
    /// files are written whatever the verifier says (it prints the verdict; `pipec check OUT`
    /// lists where Megatron's handshake deadlocks or crosses shapes); pipec's runtimes refuse
    /// them: a plan with --microbatch-lengths needs no handshake.
    #[arg(long)]
    pub megatron_variable_seq_lengths: bool,
    /// Which communicator carries each send and receive, recorded in the manifest and
    /// verified: pair (default; one per pair of ranks, torch's lazy per-pair communicators),
    /// direction (one for downstream activations, one for upstream gradients, over all ranks:
    /// pytorch #186173) or edge (one per directed pair of ranks: pytorch #196666). NCCL runs
    /// one communicator's ops in issue order, so `pipec check` reports the head-of-line waits
    /// and deadlocks of the groups chosen; pipec.torch and the CUDA runtime create them.
    #[arg(long, value_name = "GROUPS", value_parser = parse_groups, default_value = "pair")]
    pub p2p_groups: pipec_schedules::P2pGroups,
    /// Decoder layers: checked against --layout; without one, split evenly over the stages.
    #[arg(long)]
    pub num_layers: Option<u32>,
    /// MTP layers: checked against --layout; without one, on the last stage.
    #[arg(long)]
    pub mtp_num_layers: Option<u32>,
    /// Refuse schedules with more compute ops than this.
    #[arg(long, default_value_t = Limits::DEFAULT.max_compute_ops,
          value_parser = clap::value_parser!(u64).range(1..=pipec_schedules::MAX_COMPUTE_OPS))]
    pub max_ops: u64,
    /// Encoding of the rank files: json (default, readable) or bin (postcard, compact).
    #[arg(long = "format", value_enum, default_value_t = FileFormat::Json)]
    pub format: FileFormat,
    /// Most memory a rank may hold (parameters + live activations), exceeding it is a
    /// violation: bytes with a unit (80GiB) when the cost model gives memory in bytes
    /// (--cost t.act=1.5GiB), or a plain number of layer-activations.
    #[arg(long, value_parser = super::parse_limit, allow_hyphen_values = true)]
    pub memory_limit: Option<pipec_cost::memory::Limit>,
    /// The cost model memory is counted with (K.act, K.param); recorded in the manifest.
    #[command(flatten)]
    pub cost: super::args::CostArgs,
    /// Write the schedule without verifying it (not recommended).
    #[arg(long)]
    pub no_verify: bool,
    /// Output directory.
    #[arg(short = 'o', long = "out")]
    pub out: PathBuf,
    /// A static buffer plan: every send and receive of a tensor gets a `slot` of its rank's
    /// message-buffer pool and the manifest its `buffer_slots` (each slot's size in the cost
    /// model's memory unit: bytes of the stage-boundary tensor with a [model] table, else
    /// `msg`). As few slots per rank as the most messages live at once; the pools count in the
    /// memory figures and the limit. docs/format.md, "Buffer plan".
    #[arg(long, conflicts_with = "config")]
    pub buffer_plan: bool,
}

#[derive(clap::ValueEnum, Copy, Clone, Debug, PartialEq, Eq)]
pub enum FileFormat {
    Json,
    Bin,
}

impl FileFormat {
    pub fn encoding(self) -> files::Encoding {
        match self {
            FileFormat::Json => files::Encoding::Json,
            FileFormat::Bin => files::Encoding::Postcard,
        }
    }
}

/// `--p2p-groups` of `compile` and `tune`: one parser, one error text.
pub(crate) fn parse_groups(s: &str) -> Result<pipec_schedules::P2pGroups, String> {
    s.parse()
}

pub fn parse_kind(s: &str) -> Result<ScheduleKind, String> {
    s.parse::<ScheduleKind>().map_err(|e| e.to_string())
}

impl Args {
    fn limits(&self) -> Limits {
        Limits {
            max_compute_ops: self.max_ops,
        }
    }

    /// The single-schedule request; clap guarantees the three fields without `--config`.
    pub fn request(&self) -> Result<CompileRequest, CliError> {
        let missing = |f: &str| CliError::Usage(format!("--{f} is required (or give --config)"));
        let kind = self.schedule.ok_or_else(|| missing("schedule"))?;
        let pp = self.pp.ok_or_else(|| missing("pp"))?;
        let lengths = self.lengths.load()?;
        let microbatches =
            super::args::LengthsArgs::microbatches(lengths.as_ref(), self.microbatches)?;
        Ok(CompileRequest {
            kind,
            pp,
            vpp: self.vpp,
            microbatches: microbatches.ok_or_else(|| missing("microbatches"))?,
            group_size: self.group_size,
            forward_only: self.forward_only,
            combined: self.combined,
            megatron_p2p: self
                .megatron_p2p
                .unwrap_or_else(|| MegatronP2p::default_for(kind, pp)),
            layout: self.layout.clone(),
            num_layers: self.num_layers,
            mtp_num_layers: self.mtp_num_layers,
            limits: self.limits(),
            megatron_partial_recompute: self.megatron_partial_recompute,
            lengths,
            microbatch_order: self.microbatch_order.clone(),
            megatron_variable_seq_lengths: self.megatron_variable_seq_lengths,
            p2p_groups: self.p2p_groups,
            buffer_plan: self.buffer_plan,
        })
    }
}

/// Compile errors are the user's input being invalid: exit 1, with the layout caret if any.
pub fn compile_error(e: CompileError) -> CliError {
    match e {
        CompileError::Layout(l) => CliError::Invalid(super::layout::render_error(&l)),
        // The library names parameters; the edge adds the flag that changes a limit.
        CompileError::Spec(s @ SpecError::TooLarge { .. }) => {
            CliError::Invalid(format!("{s} (raise it with --max-ops)"))
        }
        CompileError::Spec(s @ SpecError::ChunksNotGiven { .. }) => {
            CliError::Invalid(format!("{s} (--vpp, or --layout)"))
        }
        CompileError::Spec(s) => CliError::Invalid(s.to_string()),
        e @ (CompileError::UnevenLayers { .. }
        | CompileError::TooManyLayers { .. }
        | CompileError::PartialRecompute(_)
        | CompileError::Checkpoint(_)
        | CompileError::LengthsCount { .. }
        | CompileError::Order { .. }
        | CompileError::Lengths(_)
        | CompileError::ShapesNeedMegatron { .. }
        | CompileError::LayersDisagree(_)) => CliError::Invalid(e.to_string()),
    }
}

/// A request that did not become a prepared program: the compile error, or the memory limit
/// refused as `--memory-limit` ([`super::resolve_limit`]'s words).
fn build_error(e: BuildError) -> CliError {
    match e {
        BuildError::Compile(e) => compile_error(e),
        BuildError::Memory(e) => CliError::Invalid(format!("--memory-limit: {e}")),
        BuildError::Rejected(r) => CliError::Invalid(r.report.verdict_line()),
    }
}

pub fn run(mut a: Args) -> Result<ExitCode, CliError> {
    if let Some(cfg) = &a.config {
        return sweep(&a, cfg);
    }
    if let Some(path) = &a.layout_file {
        a.layout = Some(super::layout::read_layout_file(path)?);
    }
    let model = a.cost.model()?;
    let req = a.request()?;
    let progress = super::spinner("generating and lowering");
    // The orders are lowered: freed here, before verifying and writing.
    let c = prepare(&req, &model, a.memory_limit).map_err(build_error)?;
    if a.no_verify {
        eprintln!(
            "WARNING: --no-verify: this schedule was NOT verified; it may deadlock, hang or compute on the wrong tensors{}",
            if a.memory_limit.is_some() { " (--memory-limit was not checked either)" } else { "" }
        );
    }
    let header = Header {
        source: "generated",
        schedule: Some(c.spec),
        layout: &c.layout,
    };
    progress.set_message(format!(
        "verifying and writing {} instructions",
        c.program.len()
    ));
    // Verification and the files run side by side: the files go to a staging directory that
    // takes the place of the output only once the verifier has passed the schedule, so an
    // invalid schedule never reaches the output unless the user insists with --no-verify.
    let threads = files::threads_for(c.program.len() as u64);
    // JSON keeps every core busy writing, so the verifier takes one; binary files are small
    // enough to leave it the others (bench/HISTORY.md has the timings behind this split).
    let verifier_threads = match a.format.encoding() {
        files::Encoding::Json => 1,
        files::Encoding::Postcard => threads,
    };
    // Megatron's handshake is written as Megatron posts it, bugs included: the verdict is the
    // point, printed below, not a gate.
    let handshake = a.megatron_variable_seq_lengths;
    let verify = || {
        if a.no_verify || handshake {
            return Ok(files::Warrant::Unverified(Unverified::unchecked(
                &c.program,
            )));
        }
        c.verify_on(verifier_threads)
            .map(files::Warrant::Verified)
            .map_err(|r| super::refusing_to_write(&a.out, &r.report))
    };
    let verdict = std::thread::scope(|s| {
        // A small schedule is verified and then written on this thread (see threads_for).
        let verifying = (threads > 1).then(|| s.spawn(verify));
        let prepared = files::prepare(&header, &c.program, a.format.encoding())
            .with_cost(a.cost.given().then(|| model.spec()));
        let gate = || {
            let bytes = prepared.bytes();
            let verdict = match verifying {
                Some(v) => v.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
                None => verify(),
            }?;
            super::warn_big_write(bytes, &a.out);
            Ok(verdict)
        };
        super::write_gated(&a.out, &prepared, threads, gate)
    });
    progress.finish_and_clear();
    let verdict = verdict?;
    println!(
        "compiled {} pp={} vpp={} microbatches={}: {}, {}, {} -> {}",
        c.spec.kind,
        c.spec.pp,
        c.spec.vpp,
        c.spec.microbatches,
        super::count(c.program.world() as usize, "rank"),
        super::count(c.program.num_stages() as usize, "stage"),
        super::count(c.program.len(), "instruction"),
        a.out.display()
    );
    if !c.spec.megatron_p2p.is_default() {
        println!(
            "megatron p2p: {} (as Megatron runs with {})",
            c.spec.megatron_p2p,
            c.spec.megatron_p2p.config()
        );
    }
    if handshake && !a.no_verify {
        let r = c.verify_on(threads).err().map(|r| r.report);
        match r {
            None => println!("megatron handshake (variable_seq_lengths): valid"),
            Some(r) => println!(
                "megatron handshake (variable_seq_lengths): {} (pipec check {} lists them)",
                r.verdict_line(),
                a.out.display()
            ),
        }
    }
    if let Some(r) = verdict.report() {
        println!("{}", short_verdict(r, &a.out));
        // DualPipe's own loop posts both directions of a step in one batch_isend_irecv
        // (deepseek-ai/DualPipe, `_commit_and_wait_comm`): the same-peer batches are the
        // kind's, not the user's to fix, so one line says what they mean (the kinds table's
        // `same_peer_batches` flag).
        if c.spec.kind.row().flags.same_peer_batches && !r.risks.is_empty() {
            eprintln!(
                "note: {} (a rank's sends or receives in one batch) carry two tensors for the same peer, as DeepSeek's DualPipe posts them; pipec-run and pipec's adapters post them in the order written, so nothing needs doing unless your own runtime reorders the operations inside a batch (pipec check {} lists them)",
                super::count(r.risks.len(), "comm batch posting"),
                a.out.display()
            );
            return Ok(ExitCode::SUCCESS);
        }
        // Risks go to stderr, a few at a time: `pipec check` lists them all.
        const SHOWN: usize = 5;
        for k in r.risks.iter().take(SHOWN) {
            eprintln!("warning: {k}");
        }
        if r.risks.len() > SHOWN {
            eprintln!(
                "warning: ... and {} more risks of the same kind (pipec check {} --all-risks lists them all)",
                r.risks.len() - SHOWN,
                a.out.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The outcome of one configuration of a sweep.
enum Outcome {
    Ok {
        ranks: u32,
        instructions: usize,
        peak: f64,
        seconds: f64,
    },
    /// Invalid input (exit 1) or I/O (exit 2), with the reason.
    Failed { io: bool, reason: String },
}

/// Compile, verify and write one configuration of a sweep.
fn one(cfg: &sweep::Config, out: &std::path::Path, a: &Args) -> Outcome {
    let t0 = std::time::Instant::now();
    // A sweep counts in layer-activations (its files give no cost model).
    let limit = cfg
        .memory_limit
        .map(|l| Limit {
            value: l as f64,
            bytes: false,
        })
        .or(a.memory_limit);
    let c = match prepare(&cfg.request, &CostModel::default(), limit) {
        Ok(c) => c,
        Err(e) => {
            return Outcome::Failed {
                io: false,
                reason: match build_error(e) {
                    CliError::Invalid(m) | CliError::Usage(m) => m,
                },
            }
        }
    };
    let dir = out.join(&cfg.name);
    let header = Header {
        source: "generated",
        schedule: Some(c.spec),
        layout: &c.layout,
    };
    // One thread per configuration: the sweep already runs one configuration per core.
    let prepared = files::prepare(&header, &c.program, a.format.encoding());
    let r = files::write_prepared(&dir, &prepared, 1, || {
        if a.no_verify {
            return Ok(files::Warrant::Unverified(Unverified::unchecked(
                &c.program,
            )));
        }
        c.verify_on(pipec_ir::par::threads_for(c.program.len() as u64))
            .map(files::Warrant::Verified)
            .map_err(|r| super::refusing_to_write(&dir, &r.report))
    });
    let r = match r {
        Ok(r) => r,
        Err(files::Gated::Gate(CliError::Invalid(m) | CliError::Usage(m))) => {
            return Outcome::Failed {
                io: false,
                reason: m,
            }
        }
        Err(files::Gated::Write(e)) => {
            return Outcome::Failed {
                io: true,
                reason: e.to_string(),
            }
        }
    };
    Outcome::Ok {
        ranks: c.program.world(),
        instructions: c.program.len(),
        peak: r
            .report()
            .map(|r| r.memory.iter().map(|m| m.peak).fold(0.0, f64::max))
            .unwrap_or(0.0),
        seconds: t0.elapsed().as_secs_f64(),
    }
}

/// `pipec compile --config FILE -o DIR`: every configuration on a pool of worker threads (one
/// per core); one failure does not stop the others. Exit 0 when all succeed, 1 when any is
/// invalid, 2 when any hit an I/O error (or the file itself is unreadable or malformed).
fn sweep(a: &Args, path: &std::path::Path) -> Result<ExitCode, CliError> {
    if a.cost.given() {
        return Err(CliError::Usage(
            "--cost and --cost-file do not apply to --config: a sweep counts memory in layer-activations".to_string(),
        ));
    }
    super::resolve_limit(a.memory_limit, &pipec_cost::cost::CostModel::default())?;
    let text = super::read_text("--config", path)?;
    let configs = sweep::parse(&text, a.limits())
        .map_err(|e| CliError::Usage(format!("{}: {e}", path.display())))?;
    std::fs::create_dir_all(&a.out)
        .map_err(|e| CliError::Usage(format!("{}: {e}", a.out.display())))?;
    let t0 = std::time::Instant::now();
    let progress = indicatif::ProgressBar::with_draw_target(
        Some(configs.len() as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    progress.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} configurations ({elapsed})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    // One configuration per core, on the one worker pool.
    let workers = pipec_ir::par::cores().min(configs.len());
    let results = pipec_ir::par::map(configs.len(), workers, |i| {
        let o = one(&configs[i], &a.out, a);
        progress.inc(1);
        o
    });
    progress.finish_and_clear();
    let w = configs
        .iter()
        .map(|c| c.name.len())
        .max()
        .unwrap_or(4)
        .max(6);
    println!(
        "{:w$}  {:>6}  {:>5}  {:>12}  {:>8}  {:>8}",
        "config", "status", "ranks", "instructions", "peak mem", "seconds"
    );
    let (mut invalid, mut io) = (0, 0);
    let mut failures = Vec::new();
    for (cfg, outcome) in configs.iter().zip(results) {
        match outcome {
            Outcome::Ok {
                ranks,
                instructions,
                peak,
                seconds,
            } => println!(
                "{:w$}  {:>6}  {ranks:>5}  {instructions:>12}  {:>8}  {seconds:>8.3}",
                cfg.name,
                "ok",
                pipec_ir::human::num(peak)
            ),
            Outcome::Failed { io: is_io, reason } => {
                if is_io {
                    io += 1;
                } else {
                    invalid += 1;
                }
                println!(
                    "{:w$}  {:>6}",
                    cfg.name,
                    if is_io { "I/O" } else { "FAILED" }
                );
                failures.push((cfg.name.clone(), reason));
            }
        }
    }
    println!(
        "{} configurations, {} ok, {} failed, in {:.2} s on {workers} threads -> {}",
        configs.len(),
        configs.len() - invalid - io,
        invalid + io,
        t0.elapsed().as_secs_f64(),
        a.out.display()
    );
    for (name, reason) in &failures {
        eprintln!("error: {name}: {reason}");
    }
    Ok(if io > 0 {
        ExitCode::from(2)
    } else if invalid > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn parse_p2p(s: &str) -> Result<MegatronP2p, String> {
    s.parse()
}

/// The verdict line with at most 16 per-rank peaks: at pp = 100000 the full list is one line
/// of 100,000 numbers. `pipec check` prints them all.
fn short_verdict(r: &pipec_ir::verify::Report, out: &std::path::Path) -> String {
    const KEEP: usize = 16;
    let line = r.verdict_line();
    if r.memory.len() <= KEEP || !r.is_valid() {
        return line;
    }
    let key = "peak memory per rank: ";
    let Some(i) = line.find(key) else {
        return line;
    };
    format!(
        "{}{} ... ({} ranks; pipec check {} lists them all)",
        &line[..i + key.len()],
        r.memory_unit.list(r.memory[..KEEP].iter().map(|m| m.peak)),
        r.memory.len(),
        out.display()
    )
}

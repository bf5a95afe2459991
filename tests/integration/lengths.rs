//! Microbatches of different lengths (issue #38) through compile, the files and the CLI: every
//! kind compiles and verifies with lengths, every message carries its microbatch's tokens
//! (summed here from the lengths as given, independently of the library), a microbatch order
//! renames microbatches without changing the schedule, and bad lengths are refused naming
//! their line.

use super::harness::{pipec, pipec_with};
use pipec_compiler::compile::{compile, CompileError, CompileRequest};
use pipec_ir::ir::{Instr, Program};
use pipec_schedules::{ChunkRule, Compute, Lengths, ScheduleKind};

/// Packed and unpacked microbatches of uneven sizes, as lists.
fn lists(m: usize) -> Vec<Vec<i128>> {
    (0..m)
        .map(|i| match i % 4 {
            0 => vec![4096],
            1 => vec![1000, 2000, 500],
            2 => vec![300 + 17 * i as i128],
            _ => vec![8000, 1, 7],
        })
        .collect()
}

fn request(k: ScheduleKind, pp: u32, m: u32) -> CompileRequest {
    CompileRequest {
        vpp: (k.chunk_rule() == ChunkRule::Any).then_some(2),
        ..CompileRequest::new(k, pp, m)
    }
}

/// Every send and receive of `p` carries the sum of its microbatch's lengths in `l`.
fn messages_sized(p: &Program, l: &[Vec<i128>]) -> usize {
    let mut n = 0;
    for ins in p.ranks.iter().flatten() {
        if let Instr::Send {
            payload, tokens, ..
        }
        | Instr::Recv {
            payload, tokens, ..
        } = ins
        {
            let want: i128 = l[payload.mb.index()].iter().sum();
            assert_eq!(
                tokens.map(|t| t.get() as i128),
                Some(want),
                "{ins} carries the wrong tokens"
            );
            n += 1;
        }
    }
    n
}

#[test]
fn every_kind_compiles_verifies_and_sizes_every_message() {
    let m = 8;
    let l = lists(m);
    for kind in ScheduleKind::ALL {
        let req = CompileRequest {
            lengths: Some(Lengths::from_lists(l.clone()).unwrap()),
            ..request(kind, 4, m as u32)
        };
        let c = compile(&req).unwrap_or_else(|e| panic!("{kind}: {e}"));
        let report = pipec_ir::verify(&c.program, &pipec_ir::VerifyOptions::default());
        assert!(report.is_valid(), "{kind}: {report}");
        assert!(messages_sized(&c.program, &l) > 0, "{kind}: no messages");
        // The same schedule without lengths: the same instructions but for their sizes.
        let plain = compile(&request(kind, 4, m as u32)).unwrap().program;
        let mut unsized_ = c.program.clone();
        unsized_.set_lengths(None);
        assert_eq!(unsized_, plain, "{kind}: lengths changed the schedule");
    }
}

#[test]
fn a_microbatch_order_renames_microbatches_and_keeps_the_schedule() {
    let order = vec![5u32, 0, 7, 2, 1, 6, 3, 4];
    let l = lists(8);
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::ZbV,
    ] {
        let base = request(kind, 4, 8);
        let plain = compile(&base).unwrap().program;
        let req = CompileRequest {
            lengths: Some(Lengths::from_lists(l.clone()).unwrap()),
            microbatch_order: Some(order.clone()),
            ..base
        };
        let p = compile(&req).unwrap().program;
        assert!(pipec_ir::verify(&p, &Default::default()).is_valid());
        messages_sized(&p, &l);
        // Instruction by instruction, the k-th microbatch of the plain schedule is order[k].
        for (a, b) in plain.ranks.iter().flatten().zip(p.ranks.iter().flatten()) {
            let mbs = |i: &Instr| -> Vec<u32> {
                match *i {
                    Instr::Compute(c) => c.parts().map(|(_, t)| t.mb.0).collect(),
                    Instr::Send { payload, .. } | Instr::Recv { payload, .. } => vec![payload.mb.0],
                    _ => vec![],
                }
            };
            let want: Vec<u32> = mbs(a).iter().map(|&k| order[k as usize]).collect();
            assert_eq!(mbs(b), want, "{kind}: {a} became {b}");
        }
        // Rank 0's first forwards enter in the order given.
        let firsts: Vec<u32> = p.ranks[0]
            .iter()
            .filter_map(|i| match i.as_compute() {
                Some(Compute::Fwd(t)) if t.stage.0 == 0 => Some(t.mb.0),
                _ => None,
            })
            .collect();
        assert_eq!(firsts, order, "{kind}");
    }
}

#[test]
fn bad_counts_and_orders_are_typed_errors() {
    let l = Lengths::from_lists(lists(6)).unwrap();
    let req = CompileRequest {
        lengths: Some(l),
        ..request(ScheduleKind::OneFOneB, 2, 8)
    };
    assert!(matches!(
        compile(&req),
        Err(CompileError::LengthsCount {
            given: 6,
            microbatches: 8
        })
    ));
    for (order, why) in [
        (vec![0, 1, 2], "3 entries"),
        (vec![0, 1, 1, 3], "1 appears twice"),
        (vec![0, 1, 9, 3], "9 is out of range"),
    ] {
        let req = CompileRequest {
            microbatch_order: Some(order),
            ..request(ScheduleKind::OneFOneB, 2, 4)
        };
        let e = compile(&req).unwrap_err().to_string();
        assert!(e.contains(why), "{e}");
    }
}

#[test]
fn files_carry_lengths_and_check_show_and_simulate_read_them() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("lengths.txt");
    std::fs::write(&file, "4096\n1000, 2000 500\n300\n8000 1 7\n").unwrap();
    let dir = tmp.path().join("s");
    let out = pipec_with(["compile", "--schedule", "interleaved-1f1b", "--pp", "2"])
        .args(["--vpp", "2", "--microbatch-lengths"])
        .arg(&file)
        .arg("-o")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let loaded = pipec_ir::files::load_dir(&dir).unwrap();
    let want = vec![
        vec![4096],
        vec![1000, 2000, 500],
        vec![300],
        vec![8000, 1, 7],
    ];
    assert_eq!(
        loaded.manifest.microbatch_lengths,
        Some(Lengths::from_lists(want.clone()).unwrap())
    );
    // Three stage boundaries, an activation and a gradient per microbatch each, at both ends.
    assert_eq!(messages_sized(&loaded.program, &want), 3 * 2 * 4 * 2);
    let manifest = std::fs::read_to_string(dir.join("manifest.json")).unwrap();
    assert!(manifest.contains("\"microbatch_lengths\""), "{manifest}");
    for cmd in ["check", "show", "simulate"] {
        let o = pipec().arg(cmd).arg(&dir).output().unwrap();
        assert!(
            o.status.success(),
            "{cmd}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let text = String::from_utf8_lossy(&o.stdout);
        if cmd != "check" {
            assert!(
                text.contains("lengths 300-8008 tokens per microbatch"),
                "{cmd}: {text}"
            );
        }
    }
    // The trace names each message's size.
    let o = pipec_with(["export", "--format", "chrome-trace"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(o.status.success());
    let trace = String::from_utf8_lossy(&o.stdout);
    for t in [4096, 3500, 300, 8008] {
        assert!(trace.contains(&format!("\"tokens\":{t}")), "{t}");
    }
    // torch's CSV carries no shapes: refused, with the reason.
    let o = pipec_with(["export", "--format", "torch-csv"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("carries no shapes"));
}

#[test]
fn bad_lengths_files_are_refused_naming_the_line() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |text: &str, extra: &[&str]| {
        let file = tmp.path().join("l.txt");
        std::fs::write(&file, text).unwrap();
        let o = pipec_with(["compile", "--schedule", "1f1b", "--pp", "2"])
            .args(extra)
            .arg("--microbatch-lengths")
            .arg(&file)
            .arg("-o")
            .arg(tmp.path().join("out"))
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    for (text, want) in [
        ("5\n\n6\n", "line 2: empty line"),
        ("5\n6 0\n", "line 2: length 0 is not above 0"),
        ("5\n6\n-3\n", "line 3: length -3 is not above 0"),
        ("5\n6x\n", "line 2: `6x` is not a length"),
        ("", "no microbatches"),
    ] {
        let (code, err) = run(text, &[]);
        assert_eq!(code, Some(1), "{text:?}: {err}");
        assert!(err.contains(want), "{text:?}: {err}");
    }
    let (code, err) = run("5\n6\n", &["--microbatches", "3"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("--microbatches 3 disagrees"), "{err}");
    // A sequence longer than the model's seq.
    let model = tmp.path().join("m.toml");
    std::fs::write(
        &model,
        "[model]\nhidden = 1024\nffn = 4096\nheads = 16\nseq = 4096\nvocab = 32000\n",
    )
    .unwrap();
    let (code, err) = run(
        "4096\n100 5000\n",
        &["--cost-file", model.to_str().unwrap()],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("line 2: length 5000 is longer than the model's seq = 4096"),
        "{err}"
    );
    // A file that cannot be read is an I/O error.
    let o = pipec_with(["compile", "--schedule", "1f1b", "--pp", "2"])
        .args(["--microbatch-lengths", "/nonexistent/lengths.txt", "-o"])
        .arg(tmp.path().join("out"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
}

/// The README's lengths table is what pipec computes: for each row, index order is `pipec
/// compile` of the kind on the layout tune chose, simulated; tune's order is `pipec tune
/// --kinds KIND`'s row of that kind (run from the repository root, on the committed files).
#[test]
fn readme_lengths_table_is_current() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let section = &readme[readme.find("## Microbatches of different lengths").unwrap()..];
    let rows: Vec<Vec<String>> = section
        .lines()
        .skip_while(|l| !l.starts_with("| lengths |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| l.split('|').map(|c| c.trim().to_string()).collect())
        .collect();
    assert_eq!(rows.len(), 6, "{section}");
    let tmp = tempfile::tempdir().unwrap();
    // The section's commands run as written, from the repository root (`out/` in a temporary
    // directory instead).
    let block = &section[section.find("```text\n").unwrap() + 8..];
    let block = &block[..block.find("```").unwrap()].replace("\\\n", " ");
    let mut ran = 0;
    for line in block.lines() {
        let line = line.split(" #").next().unwrap().trim();
        let words: Vec<String> = line
            .split_whitespace()
            .map(|w| match w.strip_prefix("out/") {
                Some(rest) => tmp.path().join(rest).display().to_string(),
                None => w.to_string(),
            })
            .collect();
        if words.is_empty() {
            continue;
        }
        assert_eq!(words[0], "pipec", "{line}");
        let o = pipec_with(&words[1..]).current_dir(&root).output().unwrap();
        assert!(
            o.status.success(),
            "{line}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        ran += 1;
    }
    assert_eq!(ran, 2);
    let json = |cmd: &mut std::process::Command| -> serde_json::Value {
        let o = cmd.current_dir(&root).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let gib = |x: f64| format!("{:.1} GiB", x / (1u64 << 30) as f64);
    for r in rows {
        let (file, kind) = (
            format!("bench/lengths/{}.txt", r[1]),
            r[2].split(' ').next().unwrap(),
        );
        let common = [
            "--pp",
            "8",
            "--num-layers",
            "32",
            "--cost-file",
            "bench/lengths/llama-8b.toml",
            "--microbatch-lengths",
            &file,
        ];
        let t = json(
            pipec_with(["tune"])
                .args(common)
                .args(["--target", "megatron", "--kinds", kind, "--json"]),
        );
        let best = t["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["schedule"] == kind)
            .min_by(|a, b| {
                a["makespan"]
                    .as_f64()
                    .unwrap()
                    .total_cmp(&b["makespan"].as_f64().unwrap())
            })
            .unwrap();
        let dir = tmp.path().join(format!("{}-{kind}", r[1]));
        // Costed as tune costs it for Megatron: a split backward (zb-v) takes `split_extra`
        // more there (#40 point 8); the manifest records it, so `simulate` uses it.
        let split = format!("split_extra={}", pipec_cost::cost::MEGATRON_SPLIT_EXTRA);
        let o = pipec_with(["compile", "--schedule", kind])
            .args(common)
            .args(["--cost", &split])
            .args(["--layout", best["layout"].as_str().unwrap(), "-o"])
            .arg(&dir)
            .current_dir(&root)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let s = json(pipec_with(["simulate", "--json"]).arg(&dir));
        let (a, b) = (
            s["makespan"].as_f64().unwrap(),
            best["makespan"].as_f64().unwrap(),
        );
        let index = format!("{a:.1}, {}", gib(s["peak_memory"].as_f64().unwrap()));
        let tuned = format!(
            "{b:.1} ({:+.1}%), {}",
            100.0 * (b / a - 1.0),
            gib(best["peak_memory"].as_f64().unwrap())
        );
        assert_eq!(
            [&r[3], &r[4], &r[5]],
            [
                &index,
                &tuned,
                &best["microbatch_order_rule"].as_str().unwrap().to_string()
            ],
            "README row {r:?}"
        );
        let vpp = best["vpp"].as_u64().unwrap();
        assert!(
            vpp == 1 || kind == "zb-v" || r[2].ends_with(&format!("vpp={vpp}")),
            "{r:?}"
        );
    }
}

/// torchtitan and DeepSpeed size every receive once: `tune --target` either with lengths finds
/// nothing to run, and says why; pipec.deepspeed's rule (the same `Target`) refuses the plan.
#[test]
fn targets_that_size_receives_once_refuse_lengths() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("l.txt");
    std::fs::write(&file, "4096\n100 200\n300\n8000\n").unwrap();
    for target in ["torchtitan", "deepspeed"] {
        let o = pipec_with(["tune", "--pp", "2", "--target", target])
            .arg("--microbatch-lengths")
            .arg(&file)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(1), "{target}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains(&format!("no candidate runs on {target}"))
                && err.contains("its microbatches have different lengths"),
            "{target}: {err}"
        );
    }
    let p = compile(&CompileRequest {
        lengths: Some(Lengths::parse("4096\n100 200\n").unwrap()),
        ..request(ScheduleKind::OneFOneB, 2, 2)
    })
    .unwrap()
    .program;
    use pipec_compiler::target::Target;
    assert!(Target::Deepspeed.check(&p).is_err());
    assert!(Target::Torchtitan.check(&p).is_err());
    assert!(Target::Torch.check(&p).is_ok() && Target::Megatron.check(&p).is_ok());
}

/// `compile --microbatch-order` writes what the library compiles with that order, and refuses
/// what is not a permutation.
#[test]
fn compile_takes_a_microbatch_order() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("l.txt");
    std::fs::write(&file, "4096\n100 200\n300\n8000\n").unwrap();
    let dir = tmp.path().join("s");
    let o = pipec_with(["compile", "--schedule", "1f1b", "--pp", "2"])
        .args(["--microbatch-order", "2,0,3,1", "--microbatch-lengths"])
        .arg(&file)
        .arg("-o")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want = compile(&CompileRequest {
        lengths: Some(Lengths::parse("4096\n100 200\n300\n8000\n").unwrap()),
        microbatch_order: Some(vec![2, 0, 3, 1]),
        ..request(ScheduleKind::OneFOneB, 2, 4)
    })
    .unwrap()
    .program;
    assert_eq!(pipec_ir::files::load_dir(&dir).unwrap().program, want);
    let o = pipec_with(["compile", "--schedule", "1f1b", "--pp", "2"])
        .args(["--microbatches", "4", "--microbatch-order", "2,0,2,1", "-o"])
        .arg(tmp.path().join("t"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("2 appears twice"));
}

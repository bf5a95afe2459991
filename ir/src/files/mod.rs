//! Instruction files: a compiled schedule as a directory of `manifest.json` and
//! `rank-<r>.json` (format documented in `docs/format.md`).
//!
//! Files are deterministic (same input, same bytes: no timestamps, fixed key order, one
//! instruction per line), versioned (a reader refuses a version it does not know), and
//! self-checking: the manifest holds each rank file's SHA-256 and a schedule hash over the
//! spec, layout, placement and every instruction, which each rank file repeats.
//!
//! The instructions a rank file holds are defined once, in `schema.rs`'s table; every encoding
//! (JSON, postcard, the hashed bytes) is generated from it.

mod bytes;
mod canonical_parse;
mod format;
mod read;
mod schema;
mod seal;
mod write;

pub use format::{
    rank_file_name, Encoding, Header, Manifest, RankEntry, COMPUTE_ONLY_CAVEAT, FORMAT_VERSION,
    MANIFEST_FILE, MANIFEST_FORMAT, RANK_FORMAT, SEALED_BY,
};
pub use read::{
    load_dir, load_dir_then, load_dir_verified, load_files, load_manifest, load_rank,
    parse_manifest, parse_rank, sniff, FileKind, LoadError, Loaded, LoadedVerdict,
};
pub use schema::{fields_of, op_name, row_of, FieldValue, OpSchema, OPS};
pub use seal::{seal_dir, SealError, Sealed};
pub use write::{
    instructions_json, prepare, render, render_unverified, threads_for, write_prepared,
    write_program, write_unverified, write_verified, Gated, Prepared, Warrant, WriteError,
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Instr, Payload, Program};
    use crate::verify::Unverified;

    /// The samples below are not valid schedules, which the files do not care about.
    fn u(p: &Program) -> Unverified<&Program> {
        Unverified::unchecked(p)
    }
    use pipec_schedules::layout::Layout;
    use pipec_schedules::{generate, Limits, Pass, ScheduleKind, ScheduleSpec, Task};

    /// A program to write and read back: a generated schedule with every cross-rank tensor
    /// received in a batch of its own before its consumer and sent in one after its producer,
    /// the receives left in flight and waited for just before use when `waits`. Not a valid
    /// schedule (it may deadlock), which the files do not care about; the lowerings are the
    /// compiler's, and its tests write what they produce.
    struct Sample {
        spec: ScheduleSpec,
        layout: Layout,
        program: Program,
    }

    fn sample(kind: ScheduleKind, vpp: u32, m: u32, waits: bool) -> Sample {
        let spec = ScheduleSpec::new(kind, 4, vpp, m);
        let s = generate(&spec, &Limits::DEFAULT).unwrap();
        let last = s.num_stages() - 1;
        let at = |stage: u32, mb: u32| s.placement.rank_of(Task::new(stage, mb));
        let ranks = s
            .ranks
            .iter()
            .map(|order| {
                let me = order.rank;
                let mut out = Vec::new();
                let mut batch = 0;
                for op in &order.ops {
                    let (mut inputs, mut outputs) = (Vec::new(), Vec::new());
                    for (pass, t) in op.parts() {
                        let (st, mb) = (t.stage.0, t.mb.0);
                        match pass {
                            Pass::Fwd if st > 0 => {
                                inputs.push((at(st - 1, mb), Payload::act(st - 1, mb)))
                            }
                            Pass::Bwd | Pass::BwdD if st < last => {
                                inputs.push((at(st + 1, mb), Payload::grad(st + 1, mb)))
                            }
                            _ => {}
                        }
                        match pass {
                            Pass::Fwd if st < last => {
                                outputs.push((at(st + 1, mb), Payload::act(st, mb)))
                            }
                            Pass::Bwd | Pass::BwdD if st > 0 => {
                                outputs.push((at(st - 1, mb), Payload::grad(st, mb)))
                            }
                            _ => {}
                        }
                    }
                    for (peer, payload) in inputs.into_iter().filter(|x| x.0 != me) {
                        out.push(Instr::Recv {
                            peer,
                            payload,
                            batch,
                            tokens: None,
                            slot: None,
                        });
                        if waits {
                            out.push(Instr::Wait { batch });
                        }
                        batch += 1;
                    }
                    out.push(Instr::Compute(*op));
                    for (peer, payload) in outputs.into_iter().filter(|x| x.0 != me) {
                        out.push(Instr::Send {
                            peer,
                            payload,
                            batch,
                            tokens: None,
                            slot: None,
                        });
                        batch += 1;
                    }
                }
                out
            })
            .collect();
        Sample {
            spec,
            layout: Layout::uniform(s.num_stages()),
            program: Program {
                placement: s.placement.clone(),
                microbatches: m,
                forward_only: false,
                comm: Some(s.comm),
                ranks,
                lengths: None,
                p2p_groups: Default::default(),
                buffer_slots: None,
            },
        }
    }

    /// One rank's records alone (Python's `Schedule.instructions(rank)`, O(that rank)) are
    /// exactly the `instructions` of its rank file.
    #[test]
    fn instructions_json_is_the_rank_files_list() {
        let c = compiled();
        let header = header(&c);
        let files = render_unverified(&header, &u(&c.program), Encoding::Json);
        for (r, instrs) in c.program.ranks.iter().enumerate() {
            let file: serde_json::Value = serde_json::from_slice(&files[r + 1].1).unwrap();
            let alone: serde_json::Value =
                serde_json::from_slice(&instructions_json(instrs)).unwrap();
            assert_eq!(file["instructions"], alone, "rank {r}");
        }
        assert_eq!(instructions_json(&[]), b"[\n]");
    }

    fn compiled() -> Sample {
        sample(ScheduleKind::Interleaved1F1B, 2, 8, false)
    }

    fn header(c: &Sample) -> Header<'_> {
        Header {
            source: "generated",
            schedule: Some(c.spec),
            layout: &c.layout,
        }
    }

    #[test]
    fn round_trip_and_determinism() {
        let c = compiled();
        for enc in [Encoding::Json, Encoding::Postcard] {
            let a = render_unverified(&header(&c), &u(&c.program), enc);
            let b = render_unverified(&header(&c), &u(&c.program), enc);
            assert_eq!(a, b);
            let dir = std::env::temp_dir()
                .join(format!("pipec-files-test-{}-{enc:?}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            write_unverified(&dir, &header(&c), &u(&c.program), enc).unwrap();
            let loaded = load_dir(&dir).unwrap();
            assert_eq!(loaded.program, c.program);
            // Rewriting over a previous schedule is allowed, in either encoding.
            write_unverified(&dir, &header(&c), &u(&c.program), Encoding::Json).unwrap();
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// The schedule hash does not depend on the file encoding.
    #[test]
    fn schedule_hash_is_encoding_independent() {
        let c = compiled();
        let json = render_unverified(&header(&c), &u(&c.program), Encoding::Json);
        let bin = render_unverified(&header(&c), &u(&c.program), Encoding::Postcard);
        let hash = |f: &[(String, Vec<u8>)]| {
            let m: Manifest = serde_json::from_slice(&f[0].1).unwrap();
            m.schedule_hash
        };
        assert_eq!(hash(&json), hash(&bin));
        let size = |f: &[(String, Vec<u8>)]| f[1..].iter().map(|x| x.1.len()).sum::<usize>();
        assert!(
            size(&json) > 5 * size(&bin),
            "json {} bin {}",
            size(&json),
            size(&bin)
        );
    }

    /// The hand-written encoders give postcard's bytes; the size estimate is exact; the
    /// streaming writer writes what `render` returns.
    #[test]
    fn hand_written_encodings_equal_postcard() {
        use super::format::{bin_prefix, canonical, schedule_hash, InstrBin, RankFileBin};
        use super::write::{json_size, rank_file_json};
        for (kind, vpp, waits) in [
            (ScheduleKind::Interleaved1F1B, 2, false),
            (ScheduleKind::Interleaved1F1B, 3, true),
            (ScheduleKind::DualPipeV, 2, false),
            (ScheduleKind::ZbV, 2, false),
        ] {
            let c = sample(kind, vpp, 200, waits);
            let h = header(&c);
            let p = prepare(&h, &c.program, Encoding::Postcard);
            let hash = schedule_hash(&h, &c.program);
            for (r, instrs) in c.program.ranks.iter().enumerate() {
                let wire: Vec<InstrBin> = instrs.iter().map(InstrBin::from).collect();
                assert_eq!(canonical(instrs), postcard::to_stdvec(&wire).unwrap());
                let file = RankFileBin {
                    format: RANK_FORMAT.to_string(),
                    version: FORMAT_VERSION,
                    rank: r as u32,
                    world_size: 4,
                    schedule_hash: hash.clone(),
                    instructions: wire,
                };
                let mut ours = bin_prefix(r as u32, 4, &hash);
                ours.extend_from_slice(&canonical(instrs));
                assert_eq!(ours, postcard::to_stdvec(&file).unwrap());
                let json = rank_file_json(r as u32, 4, &hash, instrs);
                assert_eq!(json.len() as u64, json_size(r as u32, 4, &hash, instrs));
            }
            for enc in [Encoding::Json, Encoding::Postcard] {
                let files = render_unverified(&h, &u(&c.program), enc);
                let p = prepare(&h, &c.program, enc);
                let m: Manifest = serde_json::from_slice(&files[0].1).unwrap();
                assert_eq!(m.schedule_hash, hash);
                assert_eq!(
                    p.bytes(),
                    files.iter().map(|f| f.1.len() as u64).sum::<u64>()
                );
                let dir = std::env::temp_dir().join(format!(
                    "pipec-files-stream-{}-{kind}-{enc:?}",
                    std::process::id()
                ));
                let _ = std::fs::remove_dir_all(&dir);
                for threads in [1, 2, 5] {
                    write_prepared(&dir, &p, threads, || {
                        Ok::<_, ()>(Warrant::Unverified(u(&c.program)))
                    })
                    .unwrap();
                    let mut names: Vec<_> = std::fs::read_dir(&dir)
                        .unwrap()
                        .map(|e| e.unwrap().file_name().into_string().unwrap())
                        .collect();
                    names.sort();
                    let mut want: Vec<_> = files.iter().map(|f| f.0.clone()).collect();
                    want.sort();
                    assert_eq!(names, want);
                    for (name, bytes) in &files {
                        assert_eq!(&std::fs::read(dir.join(name)).unwrap(), bytes, "{name}");
                    }
                    assert_eq!(load_dir(&dir).unwrap().program, c.program);
                }
                std::fs::remove_dir_all(&dir).unwrap();
            }
            assert!(p.bytes() > 0);
        }
    }

    /// A gate that refuses leaves nothing behind (no output, no staging directory) and wins
    /// over a write error; one that passes lets a write error through.
    #[test]
    fn refused_gate_writes_nothing() {
        let c = compiled();
        let h = header(&c);
        let p = prepare(&h, &c.program, Encoding::Json);
        let parent = std::env::temp_dir().join(format!("pipec-files-gate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&parent);
        std::fs::create_dir_all(&parent).unwrap();
        let dir = parent.join("out");
        for threads in [1, 2] {
            match write_prepared(&dir, &p, threads, || Err::<Warrant, _>("invalid")) {
                Err(Gated::Gate("invalid")) => {}
                other => panic!("{other:?}"),
            }
            assert_eq!(std::fs::read_dir(&parent).unwrap().count(), 0);
        }
        // Parents made for the staging directory go too.
        let deep = parent.join("a/b/out");
        assert!(matches!(
            write_prepared(&deep, &p, 2, || Err::<Warrant, _>("invalid")),
            Err(Gated::Gate("invalid"))
        ));
        assert_eq!(std::fs::read_dir(&parent).unwrap().count(), 0);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("notes.txt"), "mine").unwrap();
        assert!(matches!(
            write_prepared(&dir, &p, 2, || Err::<Warrant, _>("invalid")),
            Err(Gated::Gate("invalid"))
        ));
        assert!(matches!(
            write_prepared(&dir, &p, 2, || Ok::<_, ()>(Warrant::Unverified(u(
                &c.program
            )))),
            Err(Gated::Write(WriteError::NotASchedule { .. }))
        ));
        assert_eq!(std::fs::read_dir(&parent).unwrap().count(), 1);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&parent).unwrap();
    }

    /// A warrant vouches for the program it was given: one for an equal program elsewhere
    /// does not let another's files into place.
    #[test]
    #[should_panic(expected = "a warrant for another program")]
    fn a_warrant_for_another_program_is_refused() {
        let (c, other) = (compiled(), compiled());
        let h = header(&c);
        let p = prepare(&h, &c.program, Encoding::Json);
        let dir = std::env::temp_dir().join(format!("pipec-files-warrant-{}", std::process::id()));
        let _ = write_prepared(&dir, &p, 1, || {
            Ok::<_, ()>(Warrant::Unverified(u(&other.program)))
        });
    }

    /// Ranks are loaded in parallel, but a refusal names the lowest rank at fault.
    #[test]
    fn parallel_load_reports_the_lowest_rank() {
        let c = compiled();
        let dir = std::env::temp_dir().join(format!("pipec-files-low-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write_unverified(&dir, &header(&c), &u(&c.program), Encoding::Json).unwrap();
        std::fs::write(dir.join("rank-3.json"), "{}").unwrap();
        std::fs::remove_file(dir.join("rank-1.json")).unwrap();
        // As load_dir reads a big schedule: on several threads.
        let e = super::read::load_with(&dir, Some(3), |path, buf| {
            *buf = std::fs::read(path).map_err(|source| LoadError::Io {
                path: path.to_path_buf(),
                source,
            })?;
            Ok(())
        })
        .unwrap_err();
        assert!(
            matches!(&e, LoadError::Io { path, .. } if path.ends_with("rank-1.json")),
            "{e}"
        );
        let e = load_dir(&dir).unwrap_err();
        assert!(
            matches!(&e, LoadError::Io { path, .. } if path.ends_with("rank-1.json")),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The encodings `schema.rs`'s table generates, each against serde's and postcard's and
/// read back: here, where every file that encodes is in view, so `schema.rs` uses none of
/// them.
#[cfg(test)]
mod encodings {
    use super::canonical_parse::{parse, parse_bin};
    use super::format::{bin_prefix, canonical, InstrBin, InstrJson};
    use super::schema::{every_op, fields_of, op_name, row_of, FieldValue, OPS};
    use super::write::{json_size, rank_file_json, write_instr};
    use crate::ir::{Instr, PayloadKind};
    use pipec_schedules::{Compute, Task};

    /// Every op, every field at the values whose encodings change length: each encoding the
    /// table generates agrees with serde's (JSON) and postcard's, and reads back.
    #[test]
    fn every_encoding_agrees_on_every_op() {
        let mut all = Vec::new();
        for v in [0, 1, 9, 10, 99, 100, 127, 128, 999, 16383, 16384, u32::MAX] {
            // Megatron's shape messages too: their values 2 / 3 and names are serde's and
            // postcard's (appended variants).
            for p in [
                PayloadKind::Act,
                PayloadKind::Grad,
                PayloadKind::ActShape,
                PayloadKind::GradShape,
            ] {
                all.extend(every_op(v, p));
            }
        }
        let hash = "ab".repeat(32);
        for ins in &all {
            let mut line = Vec::new();
            write_instr(&mut line, ins);
            let json = InstrJson::from(ins);
            assert_eq!(
                String::from_utf8(line.clone()).unwrap(),
                serde_json::to_string(&json).unwrap()
            );
            assert_eq!(
                Instr::from(serde_json::from_slice::<InstrJson>(&line).unwrap()),
                *ins
            );
            assert!(line.starts_with(format!("{{\"op\":\"{}\"", op_name(ins)).as_bytes()));
            let (op, fields) = fields_of(ins);
            let mut record = serde_json::Map::new();
            record.insert("op".into(), op.into());
            for (k, v) in fields {
                let v = match v {
                    FieldValue::Int(i) => serde_json::Value::from(i),
                    FieldValue::Name(n) => serde_json::Value::from(n),
                    FieldValue::True => serde_json::Value::Bool(true),
                };
                record.insert(k.into(), v);
            }
            let row = &OPS[row_of(ins)];
            assert_eq!((row.name, row.index as usize), (op, row_of(ins)));
            assert_eq!(
                serde_json::Value::Object(record),
                serde_json::from_slice::<serde_json::Value>(&line).unwrap()
            );
            let bin = InstrBin::from(ins);
            let one = std::slice::from_ref(ins);
            assert_eq!(
                canonical(one),
                postcard::to_stdvec(&vec![bin.clone()]).unwrap()
            );
            assert_eq!(Instr::try_from(bin).unwrap(), *ins);
            let file = rank_file_json(3, 9, &hash, one);
            assert_eq!(file.len() as u64, json_size(3, 9, &hash, one));
            assert_eq!(parse(&file, None).unwrap().instructions, one);
            let mut b = bin_prefix(3, 9, &hash);
            b.extend_from_slice(&canonical(one));
            assert_eq!(parse_bin(&b).unwrap().instructions, one);
        }
        assert_eq!(every_op(0, PayloadKind::Act).len(), OPS.len());
        let names: Vec<_> = every_op(0, PayloadKind::Act).iter().map(op_name).collect();
        assert_eq!(names, OPS.iter().map(|o| o.name).collect::<Vec<_>>());
    }

    /// A checkpointed forward is `fwd` with `"checkpoint":true` last, index 8 with no byte of
    /// its own; a plain `fwd` is what it always was. serde's path (a reformatted file) picks
    /// the row by the key, and refuses `false` (the key is omitted when false).
    #[test]
    fn a_checkpointed_fwd_is_fwd_with_a_key() {
        let t = Task::new(0, 3);
        let mut line = Vec::new();
        write_instr(&mut line, &Instr::FwdCheckpoint(t));
        assert_eq!(line, br#"{"op":"fwd","stage":0,"mb":3,"checkpoint":true}"#);
        line.clear();
        write_instr(&mut line, &Instr::Compute(Compute::Fwd(t)));
        assert_eq!(line, br#"{"op":"fwd","stage":0,"mb":3}"#);
        assert_eq!(canonical(&[Instr::FwdCheckpoint(t)]), [1, 8, 0, 3]);
        assert_eq!(canonical(&[Instr::Compute(Compute::Fwd(t))]), [1, 0, 0, 3]);
        let serde = |s: &str| serde_json::from_str::<InstrJson>(s).map(Instr::from);
        let spaced = r#"{ "mb": 3, "checkpoint": true, "op": "fwd", "stage": 0 }"#;
        assert_eq!(serde(spaced).unwrap(), Instr::FwdCheckpoint(t));
        assert_eq!(
            serde(r#"{"stage":0,"op":"fwd","mb":3}"#).unwrap(),
            Instr::Compute(Compute::Fwd(t))
        );
        let e = serde(r#"{"op":"fwd","stage":0,"mb":3,"checkpoint":false}"#).unwrap_err();
        assert!(e.to_string().contains("`true` or absent"), "{e}");
        let e = serde(r#"{"op":"offload","stage":0,"mb":3,"checkpoint":true}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `checkpoint`"), "{e}");
        let e = serde(r#"{"op":"reload","stage":0}"#).unwrap_err();
        assert!(e.to_string().contains("missing field `mb`"), "{e}");
        let e = serde(r#"{"op":"fwdd","stage":0,"mb":1}"#).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("unknown variant `fwdd`, expected one of `fwd`, `bwd`"),
            "{e}"
        );
        let names: Vec<_> = OPS.iter().map(|o| (o.index, o.name)).collect();
        assert_eq!(
            names[8..],
            [
                (8, "fwd"),
                (9, "offload"),
                (10, "reload"),
                (11, "wait_offload"),
                (12, "recompute"),
                (13, "send"),
                (14, "recv"),
                (15, "send"),
                (16, "recv"),
                (17, "send"),
                (18, "recv")
            ]
        );
    }

    /// A send with a buffer slot (issue #39) is `send` with `"slot"` last (after `tokens` when
    /// both), its own index; without one it keeps its bytes. serde's path picks the row by the
    /// keys present.
    #[test]
    fn a_slotted_message_is_send_with_a_key() {
        use crate::ir::{Payload, Tokens};
        use pipec_schedules::Rank;
        let send = |tokens, slot| Instr::Send {
            peer: Rank(1),
            payload: Payload::act(0, 3),
            batch: 2,
            tokens,
            slot,
        };
        let json = |i: &Instr| {
            let mut line = Vec::new();
            write_instr(&mut line, i);
            String::from_utf8(line).unwrap()
        };
        let plain = r#"{"op":"send","peer":1,"payload":"act","stage":0,"mb":3,"batch":2}"#;
        assert_eq!(json(&send(None, None)), plain);
        assert_eq!(
            json(&send(None, Some(4))),
            r#"{"op":"send","peer":1,"payload":"act","stage":0,"mb":3,"batch":2,"slot":4}"#
        );
        let t = Tokens::new(7);
        assert_eq!(
            json(&send(t, Some(4))),
            r#"{"op":"send","peer":1,"payload":"act","stage":0,"mb":3,"batch":2,"tokens":7,"slot":4}"#
        );
        assert_eq!(canonical(&[send(None, None)]), [1, 5, 1, 0, 0, 3, 2]);
        assert_eq!(canonical(&[send(None, Some(4))]), [1, 15, 1, 0, 0, 3, 2, 4]);
        assert_eq!(canonical(&[send(t, Some(4))]), [1, 17, 1, 0, 0, 3, 2, 7, 4]);
        let serde = |s: &str| serde_json::from_str::<InstrJson>(s).map(Instr::from);
        let spaced = r#"{"slot": 4, "op": "send", "peer": 1, "payload": "act", "stage": 0, "mb": 3, "batch": 2, "tokens": 7}"#;
        assert_eq!(serde(spaced).unwrap(), send(t, Some(4)));
        let spaced = r#"{"slot": 4, "op": "send", "peer": 1, "payload": "act", "stage": 0, "mb": 3, "batch": 2}"#;
        assert_eq!(serde(spaced).unwrap(), send(None, Some(4)));
        let e = serde(r#"{"op":"send","peer":1,"payload":"act","stage":0,"mb":3,"slot":4}"#)
            .unwrap_err();
        assert!(e.to_string().contains("missing field `batch`"), "{e}");
    }
}

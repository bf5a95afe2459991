//! Instruction files: a compiled schedule as a directory of `manifest.json` and
//! `rank-<r>.json` (format documented in `docs/format.md`).
//!
//! Files are deterministic (same input, same bytes: no timestamps, fixed key order, one
//! instruction per line), versioned (a reader refuses a version it does not know), and
//! self-checking: the manifest holds each rank file's SHA-256 and a schedule hash over the
//! spec, layout, placement and every instruction, which each rank file repeats.

mod format;
mod read;
mod write;

pub use format::{
    rank_file_name, Encoding, Header, Manifest, RankEntry, FORMAT_VERSION, MANIFEST_FILE,
    MANIFEST_FORMAT, RANK_FORMAT,
};
pub use read::{
    load_dir, load_files, load_manifest, load_rank, parse_manifest, parse_rank, LoadError, Loaded,
};
pub use write::{render, write_dir, WriteError};

#[cfg(test)]
mod tests {
    use super::format::InstrJson;
    use super::write::write_instr;
    use super::*;
    use crate::compile::{compile, CompileRequest};
    use crate::ir::{Instr, Payload};
    use pipec_schedules::ScheduleKind;
    use pipec_schedules::{Compute, Rank, Task};

    fn compiled() -> crate::compile::Compiled {
        compile(&CompileRequest {
            vpp: Some(2),
            ..CompileRequest::new(ScheduleKind::Interleaved1F1B, 4, 8)
        })
        .unwrap()
    }

    fn header(c: &crate::compile::Compiled) -> Header<'_> {
        Header {
            source: "generated",
            schedule: Some(c.spec),
            comm_policy: Some(c.schedule.comm),
            layout: &c.layout,
        }
    }

    /// The hand-written writer and serde's reader agree on every instruction shape.
    #[test]
    fn hand_written_lines_equal_serde_form() {
        let t = Task::new(3, 7);
        let u = Task::new(1, 2);
        let all = [
            Instr::Compute(Compute::Fwd(t)),
            Instr::Compute(Compute::Bwd(t)),
            Instr::Compute(Compute::BwdD(t)),
            Instr::Compute(Compute::BwdW(t)),
            Instr::Compute(Compute::FwdBwd { fwd: t, bwd: u }),
            Instr::Send {
                peer: Rank(2),
                payload: Payload::act(3, 7),
                batch: 9,
            },
            Instr::Recv {
                peer: Rank(0),
                payload: Payload::grad(4, 1),
                batch: 0,
            },
        ];
        for ins in all {
            let mut line = Vec::new();
            write_instr(&mut line, &ins);
            let line = String::from_utf8(line).unwrap();
            let via_serde = serde_json::to_string(&InstrJson::from(&ins)).unwrap();
            assert_eq!(line, via_serde);
            let back: InstrJson = serde_json::from_str(&line).unwrap();
            assert_eq!(Instr::from(back), ins);
        }
    }

    #[test]
    fn round_trip_and_determinism() {
        let c = compiled();
        for enc in [Encoding::Json, Encoding::Postcard] {
            let a = render(&header(&c), &c.program, enc);
            let b = render(&header(&c), &c.program, enc);
            assert_eq!(a, b);
            let dir = std::env::temp_dir()
                .join(format!("pipec-files-test-{}-{enc:?}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            write_dir(&dir, &a).unwrap();
            let loaded = load_dir(&dir).unwrap();
            assert_eq!(loaded.program, c.program);
            // Rewriting over a previous schedule is allowed, in either encoding.
            write_dir(&dir, &render(&header(&c), &c.program, Encoding::Json)).unwrap();
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// The schedule hash does not depend on the file encoding.
    #[test]
    fn schedule_hash_is_encoding_independent() {
        let c = compiled();
        let json = render(&header(&c), &c.program, Encoding::Json);
        let bin = render(&header(&c), &c.program, Encoding::Postcard);
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
}

//! Instruction files travel through CI artifacts and object stores before a job loads them.
//! The input is a manifest and rank files separated by `\n%%\n`. Two passes:
//! 1. the files as they are, through `pipec_ir::files::load_files` (every check, hashes included);
//! 2. the same files with each rank file's `sha256` in the manifest recomputed, so that mutated
//!    instructions get past the content hash and reach the rank-file parser and the verifier
//!    (the schedule hash still guards the real loader; here we call `parse_rank` directly).
//! Nothing may panic; a program the verifier calls valid must simulate without deadlock.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_ir::files::{load_files, parse_manifest, parse_rank, rank_file_name, Encoding};
use pipec_ir::verify::{verify, VerifyOptions};
use pipec_ir::Program;
use sha2::{Digest, Sha256};
use std::fmt::Write as _;
use std::path::Path;

fn split(data: &[u8]) -> Vec<&[u8]> {
    const SEP: &[u8] = b"\n%%\n";
    let mut parts = Vec::new();
    let mut rest = data;
    while let Some(i) = rest.windows(SEP.len()).position(|w| w == SEP) {
        parts.push(&rest[..i]);
        rest = &rest[i + SEP.len()..];
    }
    parts.push(rest);
    parts
}

fn hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fuzz_target!(|data: &[u8]| {
    let parts = split(data);
    let (manifest_bytes, ranks) = parts.split_first().expect("split yields one part");
    let mut files = vec![("manifest.json".to_string(), manifest_bytes.to_vec())];
    for (r, bytes) in ranks.iter().enumerate() {
        for enc in [Encoding::Json, Encoding::Postcard] {
            files.push((rank_file_name(r as u32, enc), bytes.to_vec()));
        }
    }
    let _ = load_files(&files);

    let Ok(mut manifest) = parse_manifest(Path::new("manifest.json"), manifest_bytes) else {
        return;
    };
    if ranks.len() < manifest.world_size as usize {
        return;
    }
    let mut program = Program {
        placement: manifest.placement.clone(),
        microbatches: manifest.microbatches,
        forward_only: manifest.forward_only,
        comm: manifest.comm_policy,
        lengths: manifest.microbatch_lengths.clone(),
        ranks: Vec::new(),
        p2p_groups: manifest.p2p_groups,
        buffer_slots: manifest.buffer_slots.clone(),
    };
    for r in 0..manifest.world_size {
        let bytes = ranks[r as usize];
        manifest.ranks[r as usize].sha256 = hex(bytes);
        match parse_rank(Path::new(&manifest.ranks[r as usize].file), bytes, &manifest, r) {
            Ok(instrs) => program.ranks.push(instrs),
            Err(_) => return,
        }
    }
    let report = verify(&program, &VerifyOptions::default());
    let _ = report.verdict_line();
    // The verdict as a value agrees with the report, and a verified program simulates.
    match pipec_ir::verify::verified(&program, &VerifyOptions::default()) {
        Ok(verified) => {
            assert!(report.is_valid());
            let costs =
                StageCosts::new(&CostModel::default(), &manifest.layout, program.num_stages());
            if let Err(e) = pipec_cost::simulate::simulate(&verified, &costs) {
                panic!("verified program does not simulate: {e}");
            }
        }
        Err(rejected) => assert_eq!(rejected.report, report),
    }
});

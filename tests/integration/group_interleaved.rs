//! `group-interleaved` against PipeOffload's own scheduler.
//!
//! `tests/golden/pipeoffload/orders.json.gz` was recorded by
//! `bench/pipeoffload_orders_record.py` from the authors' `group_interleaved_1f1b.py` (vendored
//! unchanged in `tests/golden/pipeoffload/upstream/`): per (pp, M, vpp, group size) each rank's
//! compute order as their `create_schedule` returns it. Every configuration must come out of
//! `generate` op for op, and the program must verify.

use flate2::read::GzDecoder;
use pipec_compiler::lower::lower;
use pipec_ir::ir::Program;
use pipec_ir::verify::{verify, VerifyOptions};
use pipec_schedules::{generate, Compute, Limits, ScheduleKind, ScheduleSpec, SpecError};
use std::io::Read;

fn golden() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/golden/pipeoffload/orders.json.gz"
    );
    let mut text = String::new();
    GzDecoder::new(std::fs::File::open(path).expect("golden orders file"))
        .read_to_string(&mut text)
        .expect("gzip text");
    serde_json::from_str(&text).expect("json")
}

/// `pp4-m8-vpp2-g3` -> (4, 8, 2, 3).
fn parse_key(k: &str) -> (u32, u32, u32, u32) {
    let n: Vec<u32> = k
        .split('-')
        .map(|p| p.trim_start_matches(char::is_alphabetic).parse().unwrap())
        .collect();
    (n[0], n[1], n[2], n[3])
}

/// Our op in their token form (`B` = bwd_D, `W` = bwd_W).
fn token(op: &Compute) -> String {
    let (c, t) = match op {
        Compute::Fwd(t) => ('F', t),
        Compute::BwdD(t) => ('B', t),
        Compute::BwdW(t) => ('W', t),
        other => panic!("group-interleaved produced {other}"),
    };
    format!("{c}{}.{}", t.stage.0, t.mb.0)
}

#[test]
fn group_interleaved_is_pipeoffloads_order_op_for_op() {
    let g = golden();
    let cases = g["cases"].as_object().unwrap();
    assert!(cases.len() > 800, "{} cases", cases.len());
    let mut checked = 0;
    for (key, case) in cases {
        let (pp, m, vpp, gs) = parse_key(key);
        let spec = ScheduleSpec {
            group_size: Some(gs),
            ..ScheduleSpec::new(ScheduleKind::GroupInterleaved, pp, vpp, m)
        };
        assert!(case.get("error").is_none(), "{key}: their code refused it");
        let s = generate(&spec, &Limits::DEFAULT).unwrap_or_else(|e| panic!("{key}: {e}"));
        let theirs = case["ranks"].as_array().unwrap();
        assert_eq!(theirs.len(), pp as usize, "{key}");
        for (r, want) in theirs.iter().enumerate() {
            let ours: Vec<String> = s.ranks[r].ops.iter().map(token).collect();
            assert_eq!(ours.join(" "), want.as_str().unwrap(), "{key} rank {r}");
        }
        // Sizes the whole program is cheap to verify at.
        if pp * vpp * m <= 256 {
            let p: Program = lower(&s);
            let v = verify(&p, &VerifyOptions::default());
            assert!(v.is_valid(), "{key}: {:?}", v.violations.first());
        }
        checked += 1;
    }
    assert_eq!(checked, cases.len());
}

#[test]
fn group_interleaved_refuses_groups_their_block_cannot_take() {
    let l = Limits::DEFAULT;
    for (pp, gs) in [(4, 5), (4, 0), (1, 2)] {
        let spec = ScheduleSpec {
            group_size: Some(gs),
            ..ScheduleSpec::new(ScheduleKind::GroupInterleaved, pp, 2, 8)
        };
        assert_eq!(
            spec.validate(&l),
            Err(SpecError::GroupOutOfRange { g: gs, pp }),
            "pp {pp} g {gs}"
        );
    }
    // The default group is pp.
    let s = generate(
        &ScheduleSpec::new(ScheduleKind::GroupInterleaved, 4, 2, 8),
        &l,
    )
    .unwrap();
    let explicit = generate(
        &ScheduleSpec {
            group_size: Some(4),
            ..ScheduleSpec::new(ScheduleKind::GroupInterleaved, 4, 2, 8)
        },
        &l,
    )
    .unwrap();
    assert_eq!(s.ranks, explicit.ranks);
}

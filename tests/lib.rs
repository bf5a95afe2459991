//! Shared helpers for pipec's end-to-end tests.

use std::path::PathBuf;

/// The conformance data the tests use, copied into the repository from the project's
/// `shared/conformance/` (published examples made by running Megatron's and torch's own code)
/// so that a plain clone runs every test. `PIPEC_SHARED` points at another `shared/` folder.
/// Panics with a clear message when it is missing: the conformance tests must not silently
/// pass without their data.
pub fn shared_dir() -> PathBuf {
    if let Ok(p) = std::env::var("PIPEC_SHARED") {
        return PathBuf::from(p);
    }
    let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/golden"));
    assert!(
        p.join("conformance").is_dir(),
        "conformance data not found at {} (set PIPEC_SHARED to the shared/ folder)",
        p.display()
    );
    p
}

/// Read a JSON file from `shared/conformance/`.
pub fn conformance_json(rel: &str) -> serde_json::Value {
    let p = shared_dir().join("conformance").join(rel);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

pub mod reference;

/// The Megatron P2P mode a test asks for by default (pipec's own default rule).
pub fn megatron_p2p_for(
    kind: pipec_schedules::ScheduleKind,
    pp: u32,
) -> pipec_schedules::MegatronP2p {
    pipec_schedules::MegatronP2p::default_for(kind, pp)
}

/// Instruction constructors for hand-written programs.
pub mod ir {
    use pipec_ir::ir::{Instr, Payload};
    use pipec_schedules::{Compute, Rank, Task};

    pub fn fwd(stage: u32, mb: u32) -> Instr {
        Instr::Compute(Compute::Fwd(Task::new(stage, mb)))
    }

    pub fn bwd(stage: u32, mb: u32) -> Instr {
        Instr::Compute(Compute::Bwd(Task::new(stage, mb)))
    }

    pub fn send(peer: u32, payload: Payload, batch: u32) -> Instr {
        Instr::Send {
            peer: Rank(peer),
            payload,
            batch,
            tokens: None,
            slot: None,
        }
    }

    pub fn recv(peer: u32, payload: Payload, batch: u32) -> Instr {
        Instr::Recv {
            peer: Rank(peer),
            payload,
            batch,
            tokens: None,
            slot: None,
        }
    }
}

/// `p` with the verifier's verdict, for a test that holds a valid program: what the writers,
/// the exporters, the simulator and the runtimes take. Panics with the violations otherwise.
pub fn verified(p: &pipec_ir::Program) -> pipec_ir::verify::Verified<&pipec_ir::Program> {
    pipec_ir::verify::verified(p, &Default::default())
        .unwrap_or_else(|r| panic!("does not verify: {}", r.report.verdict_line()))
}

/// `p` with nothing proved: for tests that write, simulate or run programs the verifier
/// refuses (or that judge it themselves), through the `--no-verify` entry points.
pub fn unverified(p: &pipec_ir::Program) -> pipec_ir::verify::Unverified<&pipec_ir::Program> {
    pipec_ir::verify::Unverified::unchecked(p)
}

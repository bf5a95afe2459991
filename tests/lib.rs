//! Shared helpers for pipec's end-to-end tests.

use std::path::PathBuf;

/// The project's `shared/` folder (DESIGN.md, seeds, conformance), which sits beside the
/// checkout. `PIPEC_SHARED` overrides. Panics with a clear message when it is missing: the
/// conformance tests must not silently pass without their data.
pub fn shared_dir() -> PathBuf {
    if let Ok(p) = std::env::var("PIPEC_SHARED") {
        return PathBuf::from(p);
    }
    let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared"));
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

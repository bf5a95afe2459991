//! The tuner takes its memory limit as given and resolves it against the cost model's unit with
//! the rule every caller shares (`Limit::resolve_for`): a byte limit without byte costs is
//! refused, not read as a number of layer-activations that anything meets.

use pipec_cost::cost::CostModel;
use pipec_cost::memory::Limit;
use pipec_tune::{tune, TuneError, TuneRequest};

fn request(limit: &str, costs: &str) -> TuneRequest {
    TuneRequest {
        num_layers: Some(8),
        memory_limit: Some(Limit::parse(limit).unwrap()),
        ..TuneRequest::new(4, 8, CostModel::parse(costs).unwrap())
    }
}

#[test]
fn a_byte_limit_needs_byte_costs() {
    let e = tune(&request("40GiB", "f=1,b=1,w=1")).unwrap_err();
    assert!(matches!(e, TuneError::Limit(_)), "{e}");
    assert!(
        e.to_string()
            .contains("is in bytes, but the cost model gives memory in layer-activations"),
        "{e}"
    );
    // With byte costs the same limit is bytes, and a plain number is the model's unit.
    let t = tune(&request("40GiB", "t.act=1GiB")).unwrap();
    assert!(t
        .peak_memory
        .iter()
        .all(|&p| p <= 40.0 * (1u64 << 30) as f64));
    let r = request("6", "f=1,b=1,w=1");
    assert_eq!(r.limit(), Some(6.0));
    let t = tune(&r).unwrap();
    assert!(
        t.peak_memory.iter().all(|&p| p <= 6.0),
        "{:?}",
        t.peak_memory
    );
}

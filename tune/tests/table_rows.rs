//! The report's table (`Tuned::table_rows`, issue #40): the winner first, a plan weighed twice
//! shown once, and a long table cut to the best row of each schedule kind and placement. The
//! expected rows are recomputed here from `candidates` (the JSON's list), not by the code
//! under test.

use pipec_cost::cost::CostModel;
use pipec_cost::memory::Limit;
use pipec_tune::{tune, Candidate, CandidateKind, TuneRequest, LONG_TABLE};

/// The fields that name a plan (kind, vpp, group size, placement, heuristic, layout, order,
/// levers).
fn key(c: &Candidate) -> String {
    format!(
        "{:?} {} {:?} {} {:?} {} {:?} {:?} {:?}",
        c.schedule,
        c.vpp,
        c.group_size,
        c.placement,
        c.heuristic,
        c.layout,
        c.microbatch_order,
        c.microbatch_order_rule,
        c.levers
    )
}

#[test]
fn winner_first_and_a_plan_weighed_twice_shown_once() {
    // pp=2, M=4, uniform costs: ZB-H1 and pipec's own order tie at 26; the tie goes to the
    // built-in kind with the smaller peak, while the table's own order (makespan alone) puts
    // the tuned order first, so the check has teeth.
    let req = TuneRequest {
        num_layers: Some(4),
        ..TuneRequest::new(2, 4, CostModel::parse("f=1,b=1,w=1").unwrap())
    };
    let mut t = tune(&req).unwrap();
    assert_ne!(
        key(&t.candidates[0]),
        key(&t.best),
        "the table's order already leads with the winner"
    );
    let rows = t.table_rows(true);
    assert_eq!(key(rows.rows[0]), key(&t.best));
    assert_eq!(rows.rows.len(), t.candidates.len());
    assert_eq!((rows.merged, rows.hidden), (0, 0));
    // After the winner, the table's order.
    let rest: Vec<String> = t
        .candidates
        .iter()
        .filter(|c| key(c) != key(&t.best))
        .map(key)
        .collect();
    let shown: Vec<String> = rows.rows[1..].iter().map(|c| key(c)).collect();
    assert_eq!(shown, rest);
    // Two candidates weighed twice (the winner and another): each printed once.
    let n = t.candidates.len();
    let (w, other) = (t.best.clone(), t.candidates[0].clone());
    t.candidates.push(w);
    t.candidates.insert(1, other);
    let rows = t.table_rows(true);
    assert_eq!((rows.rows.len(), rows.merged), (n, 2));
    assert_eq!(key(rows.rows[0]), key(&t.best));
}

#[test]
fn long_table_is_cut_to_the_best_of_each_kind_and_placement() {
    // docs/tune.md's worked example: 62 layers, embedding and output layer, 40 GiB.
    let model = CostModel::parse(
        "t.f=1,t.b=1.5,t.w=0.7,E.f=2,E.b=2,E.w=1,L.f=3,L.b=3,L.w=1,t.act=0.5GiB,t.param=1.2GiB,E.param=4GiB,L.param=4GiB",
    )
    .unwrap();
    let req = TuneRequest {
        num_layers: Some(62),
        memory_limit: Some(Limit::parse("40GiB").unwrap()),
        ..TuneRequest::new(8, 64, model)
    };
    let t = tune(&req).unwrap();
    assert!(t.candidates.len() > LONG_TABLE, "{}", t.candidates.len());
    // Every plan, the winner first, with --all.
    // Every plan once, the winner first, with --all. Here a lever plan of the bidirectional
    // placement is weighed twice (the same plan, the same figures): one row.
    let mut distinct: Vec<String> = t.candidates.iter().map(key).collect();
    distinct.sort();
    distinct.dedup();
    assert!(distinct.len() < t.candidates.len(), "no plan weighed twice");
    let all = t.table_rows(true);
    assert_eq!(all.rows.len(), distinct.len());
    assert_eq!(all.merged, t.candidates.len() - distinct.len());
    assert_eq!(all.hidden, 0);
    assert_eq!(key(all.rows[0]), key(&t.best));
    // By default: per (kind, placement), the winner's group led by the winner, every other
    // group by its first candidate in the table's order.
    let group = |c: &Candidate| (c.schedule, c.placement.clone());
    let mut want: Vec<&Candidate> = vec![&t.best];
    for c in &t.candidates {
        if !want.iter().any(|w| group(w) == group(c)) {
            want.push(c);
        }
    }
    let cut = t.table_rows(false);
    let got: Vec<String> = cut.rows.iter().map(|c| key(c)).collect();
    let want: Vec<String> = want.iter().map(|c| key(c)).collect();
    assert_eq!(got, want);
    assert_eq!(cut.hidden, distinct.len() - want.len());
    assert!(cut.hidden > 0);
    // Both kinds of rows are there: pipec's own orders and built-in kinds.
    assert!(cut.rows.iter().any(|c| c.schedule == CandidateKind::Tuned));
    assert!(cut.rows.iter().any(|c| c.schedule != CandidateKind::Tuned));
}

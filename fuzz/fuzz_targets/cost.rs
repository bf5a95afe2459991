//! Cost specs (`--cost`) are typed by hand. Parsing must fail with a message or give a model
//! the simulator can run to the end: no panic, and no NaN or negative-length span in the
//! timeline it produces.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_schedules::{generate, Limits, ScheduleKind, ScheduleSpec};
use std::sync::OnceLock;

fn program() -> &'static pipec_ir::Program {
    static P: OnceLock<pipec_ir::Program> = OnceLock::new();
    P.get_or_init(|| {
        let spec = ScheduleSpec::new(ScheduleKind::Interleaved1F1B, 2, 2, 4);
        pipec_compiler::lower(&generate(&spec, &Limits::DEFAULT).expect("spec is valid"))
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(model) = CostModel::parse(text) else {
        return;
    };
    let _ = model.describe();
    let program = program();
    let costs = StageCosts::uniform(&model, program.num_stages());
    let verified = pipec_ir::verify::verified(program, &Default::default()).expect("valid");
    let sim = pipec_cost::simulate::simulate(&verified, &costs).expect("a valid schedule simulates");
    for rank in &sim.timeline.ranks {
        for span in rank {
            assert!(span.start <= span.end, "span {span:?} (NaN or negative duration)");
        }
    }
});

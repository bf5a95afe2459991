//! torch CSV schedules come from users' own tools. Import must return a positioned error or a
//! program; the verifier must judge any imported program without panicking; and a program it
//! calls valid must simulate to the end (the simulator's deadlock detector agrees).
#![no_main]
use libfuzzer_sys::fuzz_target;
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_compiler::torch::{import_csv_bytes, ImportOptions, PlacementChoice};
use pipec_ir::verify::{verify, VerifyOptions};

fuzz_target!(|data: &[u8]| {
    let Some((&knobs, csv)) = data.split_first() else {
        return;
    };
    let opts = ImportOptions {
        pp: (knobs & 0x08 != 0).then_some(u32::from(knobs & 0x07) + 1),
        placement: match knobs >> 6 {
            1 => Some(PlacementChoice::Loop),
            2 => Some(PlacementChoice::V),
            _ => None,
        },
    };
    let Ok(imported) = import_csv_bytes(csv, &opts) else {
        return;
    };
    let program = &imported.program;
    let report = verify(program, &VerifyOptions::default());
    let _ = report.verdict_line();
    if let Ok(verified) = pipec_ir::verify::verified(program, &VerifyOptions::default()) {
        let costs = StageCosts::uniform(&CostModel::default(), program.num_stages());
        if let Err(e) = pipec_cost::simulate::simulate(&verified, &costs) {
            panic!("verified program does not simulate: {e}");
        }
    }
});

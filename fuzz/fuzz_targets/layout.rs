//! Layout strings come from config files people edit by hand. `parse` and `check_against`
//! must return an error, never panic, hang or allocate without bound; and whatever `parse`
//! accepts must read back the same from its expanded form (Megatron's printed layout).
#![no_main]
use libfuzzer_sys::fuzz_target;
use pipec_schedules::layout::{check_against, parse, MAX_TEXT_BYTES};

fuzz_target!(|data: &[u8]| {
    // First byte: pp and vpp for the pipeline rules; the rest is the layout text.
    let Some((&knobs, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let pp = u32::from(knobs & 0x0f) + 1;
    let vpp = match knobs >> 4 {
        0 => None,
        v => Some(u32::from(v)),
    };
    let Ok(layout) = parse(text) else {
        return;
    };
    if let Ok(v) = check_against(&layout, pp, vpp, None, None) {
        assert_eq!(v as usize * pp as usize, layout.stages.len());
        let _ = layout.table(pp);
    }
    let expanded = layout.expanded();
    if expanded.len() <= MAX_TEXT_BYTES {
        let again = parse(&expanded).expect("the expanded form of an accepted layout parses");
        assert_eq!(again.stages, layout.stages);
    }
});

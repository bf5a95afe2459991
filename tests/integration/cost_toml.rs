//! Cost files are TOML (issue #40, point 10): files written by a TOML library (the `toml`
//! crate) read as the same model as pipec's unquoted spec; `[model]` `tflops` makes the
//! derived times absolute, checked against FLOP counts derived by hand; a bandwidth per second
//! against times in layer forwards is refused; `calibrate` warns on a poor fit and writes
//! `time_unit` as a key.

use crate::harness::pipec_with;
use pipec_cost::cost::{CostErrorKind, CostModel};
use pipec_schedules::layout::LayerKind;
use std::collections::BTreeMap;
use toml::Value;

/// `text` as a cost file.
fn read(text: &str) -> CostModel {
    let mut m = CostModel::default();
    m.apply(text, Some("c.toml"))
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
    m
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1e-300)
}

/// Every value form a TOML writer produces for the cost keys (floats, integers, booleans,
/// strings for sizes, bandwidths, units and `inf`, the float `inf`; dotted keys quoted)
/// reads as the unquoted spec with the same values.
#[test]
fn a_file_written_by_a_toml_library_reads_as_the_unquoted_spec() {
    let spec = "f=1,b=2,w=0.5,L.f=2,E.b=0.25,t.act=1.5GiB,E.param=2GiB,t.param=300MB,time_unit=ms,pcie=25GB/s,bw=inf,p2p=0.05,msg=3,rendezvous=false,overlap=0.25,offload_pair=true,rank.1=1.5,seq=4096";
    let want = CostModel::parse(spec).unwrap();
    for bw in [Value::String("inf".into()), Value::Float(f64::INFINITY)] {
        let mut map: BTreeMap<String, Value> = BTreeMap::new();
        map.insert("f".into(), Value::Float(1.0));
        map.insert("b".into(), Value::Integer(2));
        map.insert("w".into(), Value::Float(0.5));
        map.insert("L.f".into(), Value::Integer(2));
        map.insert("E.b".into(), Value::Float(0.25));
        map.insert("t.act".into(), Value::String("1.5GiB".into()));
        map.insert("E.param".into(), Value::String("2GiB".into()));
        map.insert("t.param".into(), Value::String("300MB".into()));
        map.insert("time_unit".into(), Value::String("ms".into()));
        map.insert("pcie".into(), Value::String("25GB/s".into()));
        map.insert("bw".into(), bw);
        map.insert("p2p".into(), Value::Float(0.05));
        map.insert("msg".into(), Value::Integer(3));
        map.insert("rendezvous".into(), Value::Boolean(false));
        map.insert("overlap".into(), Value::Float(0.25));
        map.insert("offload_pair".into(), Value::Boolean(true));
        map.insert("rank.1".into(), Value::Float(1.5));
        map.insert("seq".into(), Value::Integer(4096));
        let text = toml::to_string(&map).unwrap();
        // The writer's forms: dotted keys quoted, sizes and bandwidths strings.
        assert!(text.contains("\"t.act\" = \"1.5GiB\""), "{text}");
        assert!(text.contains("pcie = \"25GB/s\""), "{text}");
        assert_eq!(read(&text), want, "{text}");
    }
    // The form a person writes in TOML (a dotted key, TOML's table `t`, read as one key) with
    // quoted values: valid TOML, and the same model.
    let by_hand = "t.act = \"1.5GiB\"\nE.param = '2GiB'\nt.param = \"300MB\"\nf = 1\nb = 2\nw = 0.5\nL.f = 2\nE.b = 0.25\ntime_unit = \"ms\"\npcie = \"25GB/s\"\nbw = \"inf\"\np2p = 0.05\nmsg = 3\nrendezvous = false\noverlap = 0.25\noffload_pair = true\nrank.1 = 1.5\nseq = 4096\n";
    assert!(by_hand.parse::<toml::Table>().is_ok());
    assert_eq!(read(by_hand), want);
    // A quoted value that is wrong keeps its caret, under the text inside the quotes.
    let e = CostModel::parse("t.act = \"1.5GiX\"").unwrap_err();
    assert_eq!(e.kind, CostErrorKind::BadNumber("1.5GiX".into()));
    assert!(
        e.render()
            .ends_with("  t.act = \"1.5GiX\"\n           ^^^^^^"),
        "{}",
        e.render()
    );
    let e = CostModel::parse("\"t.bogus\" = 1").unwrap_err();
    assert_eq!(e.kind, CostErrorKind::UnknownKey("t.bogus".into()));
    assert_eq!(e.col, 2);
}

/// The GPT-like shape of the hand derivation below, as the `toml` crate writes a `[model]`
/// table (top-level keys first, then the table).
fn shape(tflops: Option<f64>, time_unit: Option<&str>) -> String {
    let mut model: BTreeMap<String, Value> = BTreeMap::new();
    for (k, v) in [
        ("hidden", 64),
        ("ffn", 256),
        ("heads", 4),
        ("seq", 32),
        ("vocab", 128),
    ] {
        model.insert(k.into(), Value::Integer(v));
    }
    model.insert("dtype".into(), Value::String("bf16".into()));
    model.insert("swiglu".into(), Value::Boolean(false));
    if let Some(t) = tflops {
        model.insert("tflops".into(), Value::Float(t));
    }
    let mut top: BTreeMap<String, Value> = BTreeMap::new();
    if let Some(u) = time_unit {
        top.insert("time_unit".into(), Value::String(u.into()));
    }
    top.insert("model".into(), Value::Table(model.into_iter().collect()));
    toml::to_string(&top).unwrap()
}

/// `[model]` `tflops`: each pass's FLOPs over `tflops * 1e12` FLOP/s, in `time_unit`.
///
/// By hand for hidden h = 64, ffn = 256, heads = kv_heads = 4, seq s = 32, one sequence,
/// vocab 128 (already a multiple of 128), tp = 1 (Narayanan et al. 2021's counting, as
/// `model.rs` states it): the weight matmuls of a forward, QKV and projection
/// `2 s h^2 (2 + 2)` = 1,048,576 and the MLP `4 s h ffn` = 2,097,152, 3,145,728 in all; the
/// attention core `4 s s h` = 262,144; the forward 3,407,872 FLOPs. The input gradient is the
/// weight matmuls again plus twice the core, 3,670,016; the weight gradient the weight matmuls,
/// 3,145,728. The output layer `2 s h v` = 524,288 in each pass. At 1 TFLOP/s one
/// microsecond holds 10^6 FLOPs.
#[test]
fn tflops_gives_absolute_times_by_hand() {
    let text = shape(Some(1.0), Some("us"));
    assert!(
        text.contains("[model]") && text.contains("tflops = 1.0"),
        "{text}"
    );
    let m = read(&text);
    let t = m.layer(LayerKind::Decoder);
    assert!(close(t.f, 3.407872), "{t:?}");
    assert!(close(t.b, 3.670016), "{t:?}");
    assert!(close(t.w, 3.145728), "{t:?}");
    let a = m.attention(LayerKind::Decoder);
    assert!(
        close(a.f, 0.262144) && close(a.b, 0.524288) && a.w == 0.0,
        "{a:?}"
    );
    let l = m.layer(LayerKind::Loss);
    assert!(close(l.f, 0.524288) && close(l.b, 0.524288) && close(l.w, 0.524288));
    assert_eq!(m.layer(LayerKind::Embedding).f, 0.0);
    assert_eq!(m.time_unit, Some(1e-6));
    let d = m.describe();
    assert!(d.contains("times in us at 1 TFLOP/s per GPU"), "{d}");
    // Without `time_unit`: seconds, and the unit is then known.
    let s = read(&shape(Some(1.0), None));
    assert!(close(s.layer(LayerKind::Decoder).f, 3.407872e-6));
    assert_eq!(s.time_unit, Some(1.0));
    // At 500 TFLOP/s in ms: 3,407,872 / 5e14 s = 6.815744e-6 ms.
    let k = read(&shape(Some(500.0), Some("ms")));
    assert!(close(k.layer(LayerKind::Decoder).f, 6.815744e-6));
    // Without `tflops`: one decoder layer's forward is the unit, and the header says so.
    let r = read(&shape(None, None));
    assert_eq!(r.layer(LayerKind::Decoder).f, 1.0);
    assert!(close(
        r.layer(LayerKind::Decoder).b,
        3_670_016.0 / 3_407_872.0
    ));
    assert!(r.describe().contains("times in decoder-layer forwards"));
    // The JSON form carries `tflops` only when given.
    let j = serde_json::to_value(&m).unwrap();
    assert_eq!(j["model"]["tflops"], 1.0);
    assert!(j.get("attn").is_none(), "{j}");
    let j = serde_json::to_value(&r).unwrap();
    assert!(j["model"].get("tflops").is_none());
    // A spec of the model reads back to the same times.
    let back = CostModel::parse(&m.spec()).unwrap();
    assert_eq!(back.layer(LayerKind::Decoder), t);
    assert_eq!(back.time_unit, m.time_unit);
    // Bad figures are refused at the value.
    for bad in ["0", "-1", "fast", "2e6", "inf"] {
        let e = CostModel::parse(&format!(
            "[model]\nhidden = 64\nffn = 256\nheads = 4\nseq = 32\nvocab = 128\ntflops = {bad}\n"
        ))
        .unwrap_err();
        assert!(matches!(e.kind, CostErrorKind::BadModelValue(_)), "{bad}");
        assert_eq!((e.line, e.col), (7, 10), "{bad}");
    }
}

/// `time_unit` and `pcie` per second with a `[model]` table: refused while the table's times
/// are in layer forwards (no `tflops`, passes not all given), accepted otherwise.
#[test]
fn bandwidth_per_second_needs_absolute_times() {
    let base = shape(None, Some("ms"));
    let with = |extra: &str| format!("{extra}\n{base}");
    let mut m = CostModel::default();
    let text = with("pcie = \"25GB/s\"");
    let e = m.apply(&text, Some("c.toml")).unwrap_err();
    assert_eq!(e.kind, CostErrorKind::PcieNeedsTflops("25GB/s".into()));
    assert!(e.render().contains("add `tflops`"), "{}", e.render());
    assert_eq!((e.line, e.col), (1, 9));
    // Only the decoder's passes given: the output layer's are still in forwards.
    let e = CostModel::parse(&with("t.f = 2\nt.b = 2\nt.w = 1\npcie = 25GB/s")).unwrap_err();
    assert_eq!(e.kind, CostErrorKind::PcieNeedsTflops("25GB/s".into()));
    // Every pass given in milliseconds (as `calibrate` writes them): accepted, 25 GB per
    // second is 2.5e7 bytes per millisecond.
    let m = CostModel::parse(&with(
        "f = 2\nb = 2\nw = 1\nL.f = 1\nL.b = 1\nL.w = 1\npcie = 25GB/s",
    ))
    .unwrap();
    assert_eq!(m.pcie, Some(2.5e7));
    // With `tflops`: accepted, in the file's unit.
    let m = read(&format!(
        "pcie = \"25GB/s\"\n{}",
        shape(Some(100.0), Some("ms"))
    ));
    assert_eq!(m.pcie, Some(2.5e7));
    // A plain `pcie` is bytes per layer forward: no unit needed.
    assert!(CostModel::parse(&with("pcie = 1e6")).is_ok());
    // A later text cannot change the unit `tflops` times were derived in.
    let mut m = read(&shape(Some(100.0), Some("ms")));
    let e = m.apply("time_unit=us", None).unwrap_err();
    assert_eq!(e.kind, CostErrorKind::TimeUnitAfterTflops("us".into()));
    m.apply("time_unit=ms", None).unwrap();
}

/// `pipec calibrate`: a trace the per-kind model cannot describe gets a warning; the file
/// carries `time_unit` as a key.
///
/// A stage of the embedding and two decoder layers (`Ett|L`, the trace names stage 0 only):
/// forwards of 1 ms and 3 ms alternate, so the least-squares pass is 2 ms, every residual 1 ms: rms 1 ms, half of the mean
/// fitted pass (2 ms), above the 10% threshold. Backwards of exactly 4 ms (no error) dilute
/// it: rms over eight events sqrt(4/8) = 0.7071 ms, the mean fitted pass (4 x 2 + 4 x 4) / 8
/// = 3 ms, 23.6%.
#[test]
fn calibrate_warns_on_a_poor_fit_and_writes_its_unit() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = |fwd: [f64; 4]| {
        let mut ev = Vec::new();
        for (mb, us) in fwd.iter().enumerate() {
            ev.push(format!(
                r#"{{"ph":"X","name":"PP:0F{mb}","dur":{}}}"#,
                us * 1000.0
            ));
            ev.push(format!(r#"{{"ph":"X","name":"PP:0B{mb}","dur":4000}}"#));
        }
        format!("[{}]", ev.join(","))
    };
    for (fwd, poor) in [([1.0, 3.0, 1.0, 3.0], true), ([2.0; 4], false)] {
        let t = tmp.path().join("trace.json");
        std::fs::write(&t, trace(fwd)).unwrap();
        let out_file = tmp.path().join("fit.toml");
        let out = pipec_with([
            "calibrate",
            t.to_str().unwrap(),
            "--layout",
            "Ett|L",
            "-o",
            out_file.to_str().unwrap(),
        ])
        .output()
        .unwrap();
        assert_eq!(out.status.code(), Some(0));
        let err = String::from_utf8_lossy(&out.stderr);
        let file = std::fs::read_to_string(&out_file).unwrap();
        assert_eq!(err.contains("warning: poor fit"), poor, "{err}");
        assert_eq!(file.contains("# poor fit"), poor, "{file}");
        if poor {
            assert!(err.contains("is 24% of the mean fitted pass"), "{err}");
        }
        // The unit is a key, not a comment, and reads as milliseconds.
        assert!(file.lines().any(|l| l == "time_unit = \"ms\""), "{file}");
        let m = read(&file);
        assert_eq!(m.time_unit, Some(1e-3));
        // The stage's forward, however the fit shares it between `E` and `t` (always
        // together), is the 2 ms mean (six decimals in the file).
        let pass = m.layer(LayerKind::Embedding).f + 2.0 * m.layer(LayerKind::Decoder).f;
        assert!((pass - 2.0).abs() < 1e-5, "{file}");
        // The file is TOML.
        assert!(file.parse::<toml::Table>().is_ok(), "{file}");
        // `--json` carries the relative error.
        let j = pipec_with([
            "calibrate",
            t.to_str().unwrap(),
            "--layout",
            "Ett|L",
            "--json",
        ])
        .output()
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&j.stdout).unwrap();
        let rel = v["relative_rms"].as_f64().unwrap();
        let want = if poor { 0.5f64.sqrt() / 3.0 } else { 0.0 };
        assert!((rel - want).abs() < 1e-9, "{rel} {want}");
    }
}

/// `tune`'s report names the unit of absolute times (`[model]` `tflops`), and keeps its
/// unit-less line without it. The makespan itself scales: at 1 TFLOP/s in microseconds the
/// same plan's times are those in forwards times 3.407872 (the forward's FLOPs over 10^6, by
/// hand above), as every pass is derived from FLOPs.
#[test]
fn tune_names_the_unit_of_absolute_times() {
    let tmp = tempfile::tempdir().unwrap();
    let makespan = |text: &str| {
        let p = tmp.path().join("m.toml");
        std::fs::write(&p, text).unwrap();
        let out = pipec_with([
            "tune",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--num-layers",
            "4",
            "--cost-file",
            p.to_str().unwrap(),
        ])
        .output()
        .unwrap();
        assert_eq!(out.status.code(), Some(0));
        let s = String::from_utf8_lossy(&out.stdout).to_string();
        let line = s
            .lines()
            .find(|l| l.starts_with("makespan: "))
            .unwrap()
            .to_string();
        let mut words = line["makespan: ".len()..].split(' ');
        let v: f64 = words.next().unwrap().parse().unwrap();
        (v, words.next().unwrap().to_string())
    };
    let (forwards, rest) = makespan(&shape(None, None));
    assert_eq!(rest, "(lower", "no unit without tflops");
    let (us, unit) = makespan(&shape(Some(1.0), Some("us")));
    assert_eq!(unit, "us");
    // The report prints a few significant digits.
    assert!(
        (us / (forwards * 3.407872) - 1.0).abs() < 1e-3,
        "{us} {forwards}"
    );
}

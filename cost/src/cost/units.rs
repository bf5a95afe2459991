//! Numbers and memory sizes as pipec reads and prints them: `40GiB`, `300MB`, `1.5`.

/// The largest memory figure (bytes or units) a spec or limit may give: 1 EiB.
pub const MAX_MEMORY: f64 = 1.152921504606847e18;

/// Parse a memory figure: a plain non-negative number, or one followed by a byte unit (`B`,
/// `KB`, `MB`, `GB`, `TB` in powers of 1000, `KiB`, `MiB`, `GiB`, `TiB` in powers of 1024;
/// case of the letters ignored, a space allowed before the unit). Returns the value and
/// whether it had a unit.
pub fn parse_memory(s: &str) -> Result<(f64, bool), String> {
    let s = s.trim();
    if s.starts_with('-') {
        return Err(format!("`{s}` is negative; a memory size is at least 0"));
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '_' | 'e' | 'E' | '+')))
        .unwrap_or(s.len());
    // `1e3` is a number, `1EiB` a unit: an `e`/`E` followed by a letter starts the unit.
    let mut split = split;
    if let Some(i) = s[..split].find(['e', 'E']) {
        if s[i + 1..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic())
        {
            split = i;
        }
    }
    let (num, unit) = (&s[..split], s[split..].trim());
    let bad =
        || format!("`{s}` is not a memory size (a number, or bytes with a unit such as 40GiB)");
    if num.is_empty() || !num.chars().next().unwrap().is_ascii_digit() && !num.starts_with('.') {
        return Err(bad());
    }
    let v: f64 = num.replace('_', "").parse().map_err(|_| bad())?;
    let scale = match unit.to_ascii_lowercase().as_str() {
        "" => 1.0,
        "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        // `40G` is either 40 GiB (what `free -g` and most GPU tools mean) or 40 GB (what disk
        // makers and SI mean), 7% apart: ask rather than guess (issue #40).
        u @ ("k" | "m" | "g" | "t") => {
            let p = u.to_ascii_uppercase();
            return Err(format!(
                "`{s}` has an ambiguous unit: did you mean {num}{p}iB or {num}{p}B?"
            ));
        }
        u @ ("ki" | "mi" | "gi" | "ti") => {
            let p = u[..1].to_ascii_uppercase();
            return Err(format!(
                "`{s}` is not a memory size: did you mean {num}{p}iB?"
            ));
        }
        _ => return Err(bad()),
    };
    let x = v * scale;
    if !x.is_finite() || !(0.0..=MAX_MEMORY).contains(&x) {
        return Err(bad());
    }
    Ok((x, !unit.is_empty()))
}

pub(super) fn parse_bytes(s: &str) -> Result<f64, String> {
    parse_memory(s).map(|(v, _)| v)
}

/// Bytes for people, as `pipec tune` prints them: GiB from 1 GiB up, else MiB.
pub fn bytes(x: f64) -> String {
    let gib = x / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.2}GiB")
    } else {
        format!("{:.1}MiB", x / (1u64 << 20) as f64)
    }
}

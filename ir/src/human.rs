//! Numbers in messages: counted nouns (`1 rank`, `4 ranks`, `8 microbatches`) and figures
//! (`2.5`, not `2.5000`). One rule for the library's reports and the CLI's lines, so neither
//! prints "1 messages".

/// `n` and `noun`, plural unless `n` is 1 (`-ch`, `-s`, `-sh`, `-x` nouns take `-es`).
pub fn count(n: impl Into<u128>, noun: &str) -> String {
    let n = n.into();
    if n == 1 {
        return format!("1 {noun}");
    }
    let es = ["ch", "sh", "s", "x"].iter().any(|e| noun.ends_with(e));
    format!("{n} {noun}{}", if es { "es" } else { "s" })
}

/// A number printed without a trailing `.0`, at most 4 decimals.
pub fn num(x: f64) -> String {
    if x.is_infinite() {
        return "inf".to_string();
    }
    let s = format!("{x:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::count;

    #[test]
    fn singular_only_for_one() {
        assert_eq!(count(1u32, "message"), "1 message");
        assert_eq!(count(0u32, "message"), "0 messages");
        assert_eq!(count(2u64, "microbatch"), "2 microbatches");
        assert_eq!(count(1u64, "microbatch"), "1 microbatch");
        assert_eq!(count(3usize as u64, "pass"), "3 passes");
    }
}

//! Numbers in machine-readable reports, rounded to what the computation means.
//!
//! Makespans and bubbles are sums of costs in binary floating point: `1944.5` comes out as
//! `1944.4999999999977`. The text output prints at most 4 decimals; the JSON keeps 12
//! significant digits, far beyond any cost model's precision, so both agree and a consumer
//! comparing `makespan == 1944.5` is not surprised.

use serde_json::Value;

/// Significant digits kept.
const DIGITS: usize = 12;

/// `x` rounded to [`DIGITS`] significant digits (non-finite values as they are).
pub fn round(x: f64) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    format!("{x:.prec$e}", prec = DIGITS - 1)
        .parse()
        .unwrap_or(x)
}

/// Every float in `v` rounded by [`round`]; integers untouched.
pub fn tidy(mut v: Value) -> Value {
    fn walk(v: &mut Value) {
        match v {
            Value::Number(n) if n.is_f64() => {
                if let Some(x) = n
                    .as_f64()
                    .and_then(|x| serde_json::Number::from_f64(round(x)))
                {
                    *n = x;
                }
            }
            Value::Array(a) => a.iter_mut().for_each(walk),
            Value::Object(o) => o.values_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut v);
    v
}

/// A memory figure as JSON: a whole number as an integer (what the unweighted count always
/// printed), others as floats ([`pipec_ir::memory::figure`]).
pub fn figure(x: f64) -> Value {
    if x.fract() == 0.0 && x.abs() < 9.0e15 {
        Value::from(x as i64)
    } else {
        Value::from(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (#29): tune's JSON printed `1944.4999999999977` where the CLI printed 1944.5.
    #[test]
    fn float_noise_is_rounded_away() {
        assert_eq!(round(1944.4999999999977), 1944.5);
        assert_eq!(round(92.59999999999997), 92.6);
        assert_eq!(round(0.19230769230769215), 0.192307692308);
        assert_eq!(round(1e-300), 1e-300);
        let v = tidy(serde_json::json!({"m": 1944.4999999999977, "n": 3, "l": [0.1 + 0.2]}));
        assert_eq!(v.to_string(), r#"{"l":[0.3],"m":1944.5,"n":3}"#);
    }
}

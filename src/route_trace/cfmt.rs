//! Fixed-point number text exactly as glibc's `printf("%.Nf")` prints it.
//!
//! Owns the float spellings of every telemetry line (trace gates, `[PIN]` gigabytes and
//! seconds). Rust's `{:.N}` already rounds the exact binary value half-to-even like glibc
//! for finite numbers (so `-0.00001` is `-0.0000` in both); only the non-finite spellings
//! differ (`NaN` against glibc's `nan`/`-nan`, `inf` against `inf`/`-inf`), and those are
//! handled here. Nothing else belongs in this file.

use std::fmt::Write;

/// Appends `x` as `%.{prec}f` would print the double `x`.
pub fn push_fixed(out: &mut String, x: f64, prec: usize) {
    if x.is_nan() {
        out.push_str(if x.is_sign_negative() { "-nan" } else { "nan" });
    } else if x.is_infinite() {
        out.push_str(if x < 0.0 { "-inf" } else { "inf" });
    } else {
        // Writing to a String cannot fail.
        let _ = write!(out, "{x:.prec$}");
    }
}

/// Appends a C `float` promoted to `double` (as a variadic `printf` argument is). The NaN
/// sign is taken from the f32 itself: the x86 promotion keeps it, and glibc prints it.
pub fn push_fixed_f32(out: &mut String, x: f32, prec: usize) {
    if x.is_nan() {
        out.push_str(if x.is_sign_negative() { "-nan" } else { "nan" });
    } else {
        push_fixed(out, f64::from(x), prec);
    }
}

/// `%.{prec}f` of `x` as a new string.
pub fn fixed(x: f64, prec: usize) -> String {
    let mut s = String::new();
    push_fixed(&mut s, x, prec);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(x: f32) -> String {
        let mut s = String::new();
        push_fixed_f32(&mut s, x, 4);
        s
    }

    #[test]
    fn glibc_spellings() {
        assert_eq!(f32s(f32::NAN), "nan");
        assert_eq!(f32s(-f32::NAN), "-nan");
        assert_eq!(f32s(f32::INFINITY), "inf");
        assert_eq!(f32s(f32::NEG_INFINITY), "-inf");
        assert_eq!(f32s(-0.0), "-0.0000");
        assert_eq!(f32s(-0.00001), "-0.0000");
        assert_eq!(f32s(0.3120), "0.3120");
        // Exact binary ties round half to even, as glibc does.
        assert_eq!(fixed(0.03125, 4), "0.0312");
        assert_eq!(fixed(0.09375, 4), "0.0938");
        assert_eq!(fixed(2.5, 0), "2");
        assert_eq!(fixed(1e20, 1), "100000000000000000000.0");
    }
}

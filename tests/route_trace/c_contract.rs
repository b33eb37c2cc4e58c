//! The old-reader contract, checked against real C: `tests/c/old_reader.c` is the classic
//! `while (fscanf(f, "%d %d %u", ...) == 3)` loop with an `l >= 0` guard, compiled with the
//! system C compiler. Also the trace's `%.4f` against glibc's printf.

use crate::support;

use std::io::Write as _;
use std::process::{Command, Stdio};

use coli::route_trace::history::{self, Trust};
use coli::route_trace::save::render;
use coli::route_trace::scan::{scan, Field};
use coli::route_trace::{fixed, push_fixed_f32, Counters, EngineId};
use proptest::prelude::*;
use support::{c_program, every_record_has_three_fields, old_read};

/// What glibc's `%d` stores: `(int)strtol(...)`, strtol saturating at the i64 range.
fn glibc_int(f: Field) -> i32 {
    let v = match (f.negative, f.magnitude) {
        (false, Some(m)) => i64::try_from(m).unwrap_or(i64::MAX),
        (true, Some(m)) => i64::try_from(-i128::from(m)).unwrap_or(i64::MIN),
        (false, None) => i64::MAX,
        (true, None) => i64::MIN,
    };
    v as i32
}

/// What glibc's `%u` stores: `(unsigned)strtoul(...)`; strtoul negates a `-` value and
/// saturates on overflow.
fn glibc_uint(f: Field) -> u32 {
    let v = match f.magnitude {
        None => u64::MAX,
        Some(m) if f.negative => m.wrapping_neg(),
        Some(m) => m,
    };
    v as u32
}

/// The GLM test history of colibri's old-reader case: layer 3 ids {2,5,7} and 2 again,
/// layer 5 ids {2,5}.
fn glm_case() -> Counters {
    let mut t = Counters::new(5, 8).expect("shape");
    t.count(3, &[2, 5, 7]);
    t.count(3, &[2]);
    t.count(5, &[2, 5]);
    t
}

#[test]
fn old_reader_admits_our_records_and_skips_both_headers() {
    let bin = c_program("old_reader");
    let d = tempfile::tempdir().expect("tempdir");
    let t = glm_case();
    let bytes = render(&t, EngineId::of("glm_moe_dsa"));
    let old = old_read(&bin, d.path(), bytes.as_bytes(), 5, 8);
    assert_eq!(old.triples[0], (-1, 5, 8));
    assert_eq!(old.triples[1], (-2, 1, 3_815_245_270));
    assert_eq!(old.admitted[..2], [false, false]);
    assert_eq!(
        old.records(),
        vec![(3, 2, 2), (3, 5, 1), (3, 7, 1), (5, 2, 1), (5, 5, 1)]
    );
    assert_eq!(old.total, 6);
    let mut back = t.zeroed_like();
    let r =
        history::parse(bytes.as_bytes(), "glm_moe_dsa", Trust::Found, &mut back).expect("accepted");
    assert_eq!(
        (r.total, r.admitted as usize),
        (old.total, old.records().len())
    );
}

/// A history carrying `-5` recent-heat records reads, in the classic C loop, exactly as the
/// same history without them: the records are skipped by `l >= 0` and keep the alignment.
#[test]
fn the_old_reader_reads_a_history_with_recent_heat_as_one_without() {
    let bin = c_program("old_reader");
    let d = tempfile::tempdir().expect("tempdir");
    let plain = glm_case();
    let mut with_heat = plain.clone();
    with_heat.admit_recent(3, 2, 17);
    with_heat.admit_recent(5, 5, 4_000_000_000);
    let id = EngineId::of("glm_moe_dsa");
    let (a, b) = (render(&plain, id), render(&with_heat, id));
    assert!(
        b.contains("\n-5 26 17\n") && b.ends_with("-5 45 4000000000\n"),
        "{b}"
    );
    assert!(every_record_has_three_fields(b.as_bytes()));
    let (old_a, old_b) = (
        old_read(&bin, d.path(), a.as_bytes(), 5, 8),
        old_read(&bin, d.path(), b.as_bytes(), 5, 8),
    );
    assert_eq!(old_b.records(), old_a.records());
    assert_eq!(old_b.total, old_a.total);
    // And we read them back as recent heat, not as selections.
    let mut back = plain.zeroed_like();
    let r = history::parse(b.as_bytes(), "glm_moe_dsa", Trust::Found, &mut back).expect("ok");
    assert!(r.is_complete(), "{r:?}");
    assert_eq!(back, with_heat);
}

#[test]
fn a_four_field_record_desynchronises_the_old_reader() {
    let bin = c_program("old_reader");
    let d = tempfile::tempdir().expect("tempdir");
    let old = old_read(&bin, d.path(), b"3 2 5\n-3 7 12 99\n4 1 8\n", 127, 8);
    assert_eq!(old.triples, vec![(3, 2, 5), (-3, 7, 12), (99, 4, 1)]);
    // A fabricated record is admitted and the real one (4, 1, 8) is lost.
    assert_eq!(old.records(), vec![(3, 2, 5), (99, 4, 1)]);
    assert_eq!(old.total, 6);
}

fn table_strategy() -> impl Strategy<Value = Counters> {
    (0usize..6, 1usize..10).prop_flat_map(|(nl, ne)| {
        (
            Just((nl, ne)),
            proptest::collection::vec(any::<bool>(), nl + 1),
            proptest::collection::vec((0..=nl, 0..ne, any::<u32>()), 0..24),
        )
            .prop_map(|((nl, ne), drop, cells)| {
                let mut t = Counters::new(nl, ne).expect("shape");
                for (l, d) in drop.iter().enumerate() {
                    if *d {
                        t.drop_row(l);
                    }
                }
                for (l, e, c) in cells {
                    t.admit(l as i64, e as i64, c);
                }
                t
            })
    })
}

fn engine_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("glm_moe_dsa".to_string()),
        Just("olmoe".to_string()),
        Just("inkling".to_string()),
        "[a-z_0-9]{1,12}",
    ]
}

/// A token of history-like text: mostly numbers of every size, sometimes junk.
fn token() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => (-3i64..12).prop_map(|v| v.to_string()),
        2 => any::<u32>().prop_map(|v| v.to_string()),
        1 => any::<i64>().prop_map(|v| v.to_string()),
        1 => Just("99999999999999999999999".to_string()),
        1 => Just("-4294967297".to_string()),
        1 => "[+-]?[0-9]{1,3}[a-z,]?",
        1 => prop_oneof![Just("x"), Just("-"), Just("+"), Just("\0")].prop_map(String::from),
    ]
}

fn separator() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        8 => Just(" "),
        4 => Just("\n"),
        1 => Just("\r\n"),
        1 => Just("\t"),
        1 => Just("\x0b\x0c"),
        1 => Just(""),
    ]
}

fn text_strategy() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec((token(), separator()), 0..40).prop_map(|v| {
        v.into_iter()
            .flat_map(|(t, s)| [t, s.to_string()])
            .collect::<String>()
            .into_bytes()
    })
}

/// Write then read is the identity on counters; the C loop admits exactly our data
/// records, skips both headers (ids above `INT_MAX` included), and every record has
/// exactly three fields.
#[test]
fn round_trip_and_old_reader() {
    // Compiled before proptest starts: without a compiler this fails once, plainly,
    // instead of as a shrunk "failing input" saved to a regressions file.
    let bin = c_program("old_reader");
    proptest!(ProptestConfig::with_cases(64), |(t in table_strategy(), name in engine_name())| {
        let id = EngineId::of(&name);
        let bytes = render(&t, id);
        prop_assert!(every_record_has_three_fields(bytes.as_bytes()));
        let mut back = t.zeroed_like();
        let r = history::parse(bytes.as_bytes(), &name, Trust::Found, &mut back);
        prop_assert!(r.as_ref().is_ok_and(|r| r.is_complete()), "{:?}", r);
        prop_assert_eq!(&back, &t);

        let d = tempfile::tempdir().expect("tempdir");
        let old = old_read(&bin, d.path(), bytes.as_bytes(), t.n_layers(), t.n_experts());
        let ours: Vec<(i32, i32, u32)> =
            t.nonzero().map(|(l, e, c)| (l as i32, e as i32, c)).collect();
        prop_assert_eq!(old.records(), ours.clone());
        prop_assert_eq!(old.total, t.total());
        if !ours.is_empty() {
            prop_assert_eq!(old.triples.len(), ours.len() + 2);
            prop_assert_eq!(old.triples[0], (-1, t.n_layers() as i32, t.n_experts() as u32));
            prop_assert_eq!(old.triples[1], (-2, 1, id.0));
        } else {
            prop_assert!(bytes.is_empty());
        }
    });
}

/// The Rust reader and the C loop agree on history-like text: the same triples in the
/// same alignment, the same stopping point, and the same admitted records, except
/// that a field outside its C type (which C silently wraps) is never admitted by us,
/// and a mismatching header refuses the whole file.
#[test]
fn rust_and_c_agree_on_text() {
    // Compiled before proptest starts: without a compiler this fails once, plainly,
    // instead of as a shrunk "failing input" saved to a regressions file.
    let bin = c_program("old_reader");
    proptest!(ProptestConfig::with_cases(64), |(bytes in text_strategy())| {
        let d = tempfile::tempdir().expect("tempdir");
        let old = old_read(&bin, d.path(), &bytes, 5, 8);
        let sc = scan(&bytes);
        let glibc: Vec<(i32, i32, u32)> = sc
            .triples
            .iter()
            .map(|t| (glibc_int(t.fields[0]), glibc_int(t.fields[1]), glibc_uint(t.fields[2])))
            .collect();
        prop_assert_eq!(&glibc, &old.triples);

        let mut ours = Counters::new(5, 8).expect("shape");
        match history::parse(&bytes, "glm_moe_dsa", Trust::Named, &mut ours) {
            Ok(report) => {
                let mut expected = Counters::new(5, 8).expect("shape");
                for (t, admitted) in sc.triples.iter().zip(&old.admitted) {
                    let [l, e, c] = t.fields;
                    if let (true, Some(l), Some(e), Some(c)) =
                        (*admitted, l.as_int(), e.as_int(), c.as_count())
                    {
                        expected.admit(l.into(), e.into(), c);
                    }
                }
                // The selections; `-5` recent-heat records, which the C loop skips, only
                // fill `ours`' recent table.
                let cells = |t: &Counters| t.nonzero().collect::<Vec<_>>();
                prop_assert_eq!(cells(&ours), cells(&expected));
                prop_assert_eq!(report.total, expected.total());
                if report.malformed == 0 {
                    prop_assert_eq!(report.total, old.total);
                }
            }
            Err(_) => {
                prop_assert_eq!(ours.total(), 0);
                prop_assert!(sc.triples.iter().any(|t| matches!(t.fields[0].as_int(), Some(-1 | -2))));
            }
        }
    });
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Arbitrary bytes never panic the reader, and whatever is admitted fits the table.
    #[test]
    fn arbitrary_bytes_never_admit_outside_the_shape(
        t in table_strategy(),
        bytes in proptest::collection::vec(any::<u8>(), 0..300),
        iku in any::<bool>(),
        engine in engine_name(),
        named in any::<bool>(),
    ) {
        let mut input = if iku { b"IKU1".to_vec() } else { Vec::new() };
        input.extend(bytes);
        let trust = if named { Trust::Named } else { Trust::Found };
        let mut table = t.zeroed_like();
        if let Ok(r) = history::parse(&input, &engine, trust, &mut table) {
            prop_assert_eq!(r.total, table.total());
            for (l, e, _) in table.nonzero() {
                prop_assert!(t.routes(l) && e < t.n_experts());
            }
        } else {
            prop_assert_eq!(table.total(), 0);
        }
    }
}

/// A deterministic spread of f32 bit patterns: specials, exact ties at 4 decimals, gates,
/// and pseudo-random patterns over the whole range (NaN payloads and subnormals included).
fn sample_floats() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN_POSITIVE,
        -0.00001,
        0.00005,
        0.99995,
        0.3120,
    ];
    v.extend((1..64).step_by(2).map(|j| j as f32 / 32.0));
    v.extend((0..1000).map(|i| i as f32 / 997.0));
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..4000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.push(f32::from_bits((x >> 32) as u32));
    }
    v
}

#[test]
fn fixed_point_text_matches_glibc_printf() {
    let bin = c_program("printf_fixed");
    let floats = sample_floats();
    let doubles: Vec<(f64, usize)> = floats
        .iter()
        .take(2000)
        .flat_map(|&f| [(f64::from(f) * 123.456, 0), (f64::from(f) / 7.0, 1)])
        .chain([(2.5, 0), (0.25, 1), (0.05, 1), (1e300, 1)])
        .collect();
    let mut input = String::new();
    for f in &floats {
        input.push_str(&format!("f {:08x}\n", f.to_bits()));
    }
    for (d, p) in &doubles {
        input.push_str(&format!("d {:016x} {p}\n", d.to_bits()));
    }
    let mut child = Command::new(&bin)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run printf_fixed");
    // Feed stdin from a thread: the output is larger than a pipe buffer.
    let mut stdin = child.stdin.take().expect("stdin");
    let feeder = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().expect("wait");
    feeder.join().expect("feeder").expect("write");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("utf8");
    let mut lines = text.lines();
    for f in &floats {
        let mut ours = String::new();
        push_fixed_f32(&mut ours, *f, 4);
        assert_eq!(
            Some(ours.as_str()),
            lines.next(),
            "bits {:08x}",
            f.to_bits()
        );
    }
    for (d, p) in &doubles {
        assert_eq!(Some(fixed(*d, *p).as_str()), lines.next(), "{d:e} %.{p}f");
    }
    assert_eq!(lines.next(), None);
}

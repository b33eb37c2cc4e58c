//! `coli trace plot`: heat maps of traces and histories and the hit-rate curve, as PNG
//! and SVG of the requested size (decoded back here), and its refusals.

use crate::common;

use std::path::Path;

use coli::route_trace::{save, Counters, EngineId};
use common::{coli, stderr, stdout};

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn png_size(path: &Path) -> (u32, u32) {
    let decoder = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(path).expect("image written"),
    ));
    let mut reader = decoder.read_info().expect("a PNG");
    let mut buf = vec![0; reader.output_buffer_size().expect("fits memory")];
    let info = reader.next_frame(&mut buf).expect("one frame");
    // Not blank: a heat map or a curve has many colours.
    let distinct: std::collections::HashSet<&[u8]> = buf[..info.buffer_size()]
        .chunks(info.color_type.samples())
        .collect();
    assert!(distinct.len() > 8, "only {} colours", distinct.len());
    (info.width, info.height)
}

fn svg_size(path: &Path) -> (u32, u32) {
    let text = std::fs::read_to_string(path).expect("image written");
    assert!(text.trim_end().ends_with("</svg>"));
    let attr = |name: &str| -> u32 {
        let at = text.find(&format!("{name}=\"")).expect("size attribute") + name.len() + 2;
        text[at..].split('"').next().unwrap().parse().unwrap()
    };
    assert!(text.contains("<text"), "labels are drawn");
    (attr("width"), attr("height"))
}

fn trace(dir: &Path) -> std::path::PathBuf {
    let mut s = String::new();
    for t in 0..30usize {
        for l in 0..4usize {
            s.push_str(&format!(
                "{} 0 {l} {}:0.6000 {}:0.4000\n",
                t * 4 + l,
                (t * 3 + l) % 16,
                (t + 5 * l) % 16
            ));
        }
    }
    let path = dir.join("t.trace");
    std::fs::write(&path, s).unwrap();
    path
}

#[test]
fn heat_map_of_a_trace_png_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(dir.path());
    let png = dir.path().join("heat.png");
    let out = coli(
        &[
            "trace",
            "plot",
            p(&t),
            "-o",
            p(&png),
            "--width",
            "640",
            "--height",
            "360",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("640 x 360 heat map"));
    assert_eq!(png_size(&png), (640, 360));
    let svg = dir.path().join("heat.svg");
    let out = coli(&["trace", "plot", p(&t), "-o", p(&svg)], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(svg_size(&svg), (1200, 700));
}

#[test]
fn heat_map_of_a_history() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = Counters::new(5, 32).unwrap();
    for l in 0..5 {
        for e in 0..32 {
            t.admit(l, e, ((l * 7 + e * 13) % 50) as u32);
        }
    }
    let h = dir.path().join("u");
    std::fs::write(&h, save::render(&t, EngineId::of("glm_moe_dsa"))).unwrap();
    let png = dir.path().join("u.PNG");
    let out = coli(
        &[
            "trace",
            "plot",
            p(&h),
            "-o",
            p(&png),
            "--width",
            "800",
            "--height",
            "500",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(png_size(&png), (800, 500));
}

#[test]
fn hit_curve() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(dir.path());
    let png = dir.path().join("curve.png");
    let out = coli(
        &[
            "trace",
            "plot",
            p(&t),
            "-o",
            p(&png),
            "--hit-curve",
            "--slots",
            "1,2,4,8",
            "--train-frac",
            "0.5",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(png_size(&png), (1200, 700));
    let svg = dir.path().join("curve.svg");
    let out = coli(
        &[
            "trace",
            "plot",
            p(&t),
            "-o",
            p(&svg),
            "--hit-curve",
            "--width",
            "300",
            "--height",
            "200",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(svg_size(&svg), (300, 200));
}

#[test]
fn refusals_are_exit_2_and_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(dir.path());
    let h = dir.path().join("u");
    std::fs::write(&h, "-1 0 4\n-2 1 3841822045\n0 1 3\n").unwrap();
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "").unwrap();
    let cases: [(Vec<&str>, &str); 5] = [
        (vec![p(&t), "-o", "x.jpg"], "must end in .png or .svg"),
        (
            vec![p(&h), "-o", "x.png", "--hit-curve"],
            "this is a history",
        ),
        (vec![p(&empty), "-o", "x.png"], "no selections to draw"),
        (
            vec![p(&t), "-o", "x.png", "--width", "10"],
            "must be between",
        ),
        (
            vec![p(&t), "-o", "x.png", "--train-frac", "0.5"],
            "--hit-curve only",
        ),
    ];
    for (args, want) in cases {
        let mut a = vec!["trace", "plot"];
        a.extend(args.iter().copied());
        let out = coli(&a, &[]);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(stderr(&out).contains(want), "{args:?}: {}", stderr(&out));
    }
    assert!(!Path::new("x.png").exists());
}

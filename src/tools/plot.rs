//! `coli trace plot`: the layers x experts heat map of selection counts, from a trace or a
//! history, and with `--hit-curve` the hit rate against slots per layer for each policy of
//! `simulate`.
//!
//! Drawn with plotters into memory (an RGB buffer encoded as PNG, or an SVG string), then
//! written atomically. Text uses an embedded ASCII subset of DejaVu Sans, so the images
//! look the same on every machine and no system font is needed.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, bail, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::colors::colormaps::{ColorMap, ViridisRGB};
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::history_file;
use super::simulate::{self, SimOptions, SimReport};
use super::trace::{TraceReader, MAX_INDEX};

/// DejaVu Sans reduced to printable ASCII, `×` and `—` (see `assets/fonts/`).
static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans-ascii.ttf");

const FONT_NAME: &str = "sans-serif";

/// Smallest and largest image side accepted, in pixels.
const SIDE: std::ops::RangeInclusive<u32> = 200..=8000;

/// Whether a file starts as the images `plot` writes do.
fn is_image(head: &[u8]) -> bool {
    let text = String::from_utf8_lossy(head);
    let text = text.trim_start();
    head.starts_with(b"\x89PNG\r\n\x1a\n") || text.starts_with("<svg") || text.starts_with("<?xml")
}

/// `coli trace plot`.
#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// A trace (ROUTE_TRACE) or a history (`.coli_usage`, legacy text, IKU1); told apart by
    /// content.
    pub input: PathBuf,
    /// The image to write: `.png` or `.svg`.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Image width in pixels.
    #[arg(long, default_value_t = 1200)]
    pub width: u32,
    /// Image height in pixels.
    #[arg(long, default_value_t = 700)]
    pub height: u32,
    /// Draw the hit rate against slots per layer of each policy (`trace simulate` on the
    /// input, which must be a trace) instead of the heat map.
    #[arg(long)]
    pub hit_curve: bool,
    #[command(flatten)]
    pub sim: SimOptions,
}

/// The image formats `plot` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// PNG, 8-bit RGB.
    Png,
    /// SVG text.
    Svg,
}

impl Format {
    /// The format named by the file's extension.
    pub fn of(path: &Path) -> Result<Format> {
        match path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("png") => Ok(Format::Png),
            Some("svg") => Ok(Format::Svg),
            _ => bail!("{}: the image must end in .png or .svg", path.display()),
        }
    }
}

/// Selection counts per layer (rows) and expert (columns).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Heat {
    /// `[layer][expert]`; every row as long as the widest.
    pub counts: Vec<Vec<u64>>,
    /// What the counts came from, for the title.
    pub source: String,
}

impl Heat {
    fn total(&self) -> u64 {
        self.counts.iter().flatten().sum()
    }

    fn max(&self) -> u64 {
        self.counts.iter().flatten().copied().max().unwrap_or(0)
    }

    fn experts(&self) -> usize {
        self.counts.first().map_or(0, Vec::len)
    }
}

/// Whether `path` holds a trace (its first line has `id:gate` pairs) rather than a history.
pub fn is_trace(path: &Path) -> Result<bool> {
    let mut head = Vec::new();
    crate::files::open_input(path)
        .with_context(|| format!("cannot open {}", path.display()))?
        .take(4096)
        .read_to_end(&mut head)
        .with_context(|| format!("cannot read {}", path.display()))?;
    if crate::route_trace::iku1::sniff(&head) {
        return Ok(false);
    }
    let first = head
        .split(|&b| b == b'\n')
        .find(|l| l.iter().any(|b| !b.is_ascii_whitespace()))
        .unwrap_or(&[]);
    Ok(first.contains(&b':'))
}

/// The most cells a heat map is drawn with: far more than a picture has pixels, and a
/// bound on the table behind it.
const MAX_CELLS: usize = 1 << 24;

/// Counts per (layer, expert): every selection of a trace, or a history's counters.
pub fn heat_of(path: &Path) -> Result<Heat> {
    let mut counts: Vec<Vec<u64>> = Vec::new();
    let mut add = |l: usize, e: usize, c: u64| {
        if counts.len() <= l {
            counts.resize_with(l + 1, Vec::new);
        }
        let row = &mut counts[l];
        if row.len() <= e {
            row.resize(e + 1, 0);
        }
        row[e] += c;
    };
    let source = if is_trace(path)? {
        let mut rd = TraceReader::open(path, false, "plot")?;
        while let Some(r) = rd.next_route()? {
            for &e in &r.ids {
                add(r.layer, e, 1);
            }
        }
        format!("trace {}", path.display())
    } else {
        let h = history_file::open_readable(path)?;
        // The picture spans the selections, not the declared shape (which may claim far
        // more than any model has); cells no model can have are left out, and said so.
        let mut beyond = 0u64;
        for (l, e, c) in h.counts.nonzero() {
            if l >= MAX_INDEX || e >= MAX_INDEX {
                beyond += u64::from(c);
            } else {
                add(l, e, u64::from(c));
            }
        }
        if beyond > 0 {
            eprintln!(
                "{}: {beyond} selections on layer or expert ids of {MAX_INDEX} or more (no model has them) are not drawn",
                path.display()
            );
        }
        format!("history {}", path.display())
    };
    let width = counts.iter().map(Vec::len).max().unwrap_or(0);
    if counts.len().saturating_mul(width) > MAX_CELLS {
        bail!(
            "{}: a heat map of {} layers x {width} experts is more cells than a picture can show (at most {MAX_CELLS})",
            path.display(),
            counts.len()
        );
    }
    for row in &mut counts {
        row.resize(width, 0);
    }
    let heat = Heat { counts, source };
    if heat.total() == 0 {
        bail!("{}: no selections to draw", path.display());
    }
    Ok(heat)
}

fn register_font() -> Result<()> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE
        .get_or_init(|| plotters::style::register_font(FONT_NAME, FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        bail!("the embedded font could not be read")
    }
}

fn draw_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing failed: {e:?}")
}

/// Round counts up to `max` for the colour scale: 1, 2, 5, 10, 20, 50, ... (only the
/// powers of ten when that would be more than eight labels).
fn round_counts(max: u64) -> Vec<u64> {
    let mut all = Vec::new();
    let mut decade = 1u64;
    while decade <= max {
        for m in [1, 2, 5] {
            if let Some(c) = decade.checked_mul(m).filter(|&c| c <= max) {
                all.push(c);
            }
        }
        match decade.checked_mul(10) {
            Some(d) => decade = d,
            None => break,
        }
    }
    if all.len() > 8 {
        all.retain(|c| c.to_string().starts_with('1'));
    }
    all
}

/// The id a segmented axis label stands for (labels sit at the centre of each cell).
fn segment_label(v: &SegmentValue<u32>) -> String {
    match v {
        SegmentValue::CenterOf(i) => i.to_string(),
        _ => String::new(),
    }
}

fn draw_heat<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, heat: &Heat) -> Result<()> {
    root.fill(&WHITE).map_err(draw_err)?;
    let (w, _) = root.dim_in_pixel();
    let (main, bar) = root.split_horizontally(w.saturating_sub(130));
    let layers = heat.counts.len() as u32;
    let experts = heat.experts() as u32;
    let top = (heat.max() as f64).ln_1p();
    let title = format!(
        "expert selections by layer: {} ({} selections)",
        heat.source,
        heat.total()
    );
    let mut chart = ChartBuilder::on(&main)
        .caption(title, (FONT_NAME, 18))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        // Integer ranges segment inclusively: `0..n-1` is n cells.
        .build_cartesian_2d(
            (0u32..experts.saturating_sub(1)).into_segmented(),
            (0u32..layers.saturating_sub(1)).into_segmented(),
        )
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("expert")
        .y_desc("layer")
        .x_labels(experts.min(32) as usize)
        .y_labels(layers.min(40) as usize)
        .x_label_formatter(&segment_label)
        .y_label_formatter(&segment_label)
        .label_style((FONT_NAME, 13))
        .axis_desc_style((FONT_NAME, 15))
        .draw()
        .map_err(draw_err)?;
    let empty = RGBColor(236, 236, 236);
    chart
        .draw_series(heat.counts.iter().enumerate().flat_map(|(l, row)| {
            row.iter().enumerate().map(move |(e, &c)| {
                let colour = if c == 0 {
                    empty
                } else {
                    ViridisRGB.get_color_normalized((c as f64).ln_1p() as f32, 0.0, top as f32)
                };
                let (e, l) = (e as u32, l as u32);
                Rectangle::new(
                    [
                        (SegmentValue::Exact(e), SegmentValue::Exact(l)),
                        (SegmentValue::Exact(e + 1), SegmentValue::Exact(l + 1)),
                    ],
                    colour.filled(),
                )
            })
        }))
        .map_err(draw_err)?;
    // The colour scale: a gradient with ticks at round counts (1, 2, 5, 10, ...).
    let mut scale = ChartBuilder::on(&bar)
        .caption("selections", (FONT_NAME, 13))
        .margin_top(12)
        .margin_bottom(50)
        .margin_right(5)
        .build_cartesian_2d(0f64..3.0, 0f64..top)
        .map_err(draw_err)?;
    const STEPS: usize = 100;
    scale
        .draw_series((0..STEPS).map(|i| {
            let a = top * i as f64 / STEPS as f64;
            let b = top * (i + 1) as f64 / STEPS as f64;
            Rectangle::new(
                [(0.0, a), (1.0, b)],
                ViridisRGB
                    .get_color_normalized(a as f32, 0.0, top as f32)
                    .filled(),
            )
        }))
        .map_err(draw_err)?;
    let ticks = round_counts(heat.max());
    let style = TextStyle::from((FONT_NAME, 12)).pos(Pos::new(HPos::Left, VPos::Center));
    scale
        .draw_series(ticks.iter().map(|&c| {
            let y = (c as f64).ln_1p();
            PathElement::new(vec![(1.0, y), (1.25, y)], BLACK)
        }))
        .map_err(draw_err)?;
    scale
        .draw_series(
            ticks
                .iter()
                .map(|&c| Text::new(c.to_string(), (1.4, (c as f64).ln_1p()), style.clone())),
        )
        .map_err(draw_err)?;
    root.present().map_err(draw_err)
}

/// One colour per policy, the same in every curve.
fn policy_colour(p: simulate::Policy) -> RGBColor {
    match p {
        simulate::Policy::Lru => RGBColor(31, 119, 180),
        simulate::Policy::Lfru => RGBColor(255, 127, 14),
        simulate::Policy::Pinned => RGBColor(44, 160, 44),
        simulate::Policy::PinLru => RGBColor(148, 103, 189),
        simulate::Policy::Guarded => RGBColor(140, 86, 75),
        simulate::Policy::Belady => RGBColor(214, 39, 40),
    }
}

fn draw_curve<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, r: &SimReport) -> Result<()> {
    root.fill(&WHITE).map_err(draw_err)?;
    let mut sizes = r.sizes.clone();
    sizes.sort_by_key(|s| s.slots);
    sizes.dedup_by_key(|s| s.slots);
    // One evenly spaced position per size, labelled with the size: sizes usually double.
    let slots: Vec<usize> = sizes.iter().map(|s| s.slots).collect();
    let label = |v: &SegmentValue<u32>| match v {
        SegmentValue::CenterOf(i) => slots
            .get(*i as usize)
            .map_or(String::new(), usize::to_string),
        _ => String::new(),
    };
    let scope = if r.train_forwards > 0 {
        format!(", scored after {} training forwards", r.train_forwards)
    } else {
        String::new()
    };
    let title = format!(
        "hit rate by slots per layer: {} ({} lookups{scope})",
        r.trace, r.lookups
    );
    let mut chart = ChartBuilder::on(root)
        .caption(title, (FONT_NAME, 18))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(
            (0u32..(slots.len() as u32).saturating_sub(1)).into_segmented(),
            0f64..100.0,
        )
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .x_desc("expert slots per layer")
        .y_desc("hit rate (%)")
        .x_labels(slots.len())
        .x_label_formatter(&label)
        .y_label_formatter(&|v| format!("{v:.0}"))
        .light_line_style(RGBColor(242, 242, 242))
        .label_style((FONT_NAME, 13))
        .axis_desc_style((FONT_NAME, 15))
        .draw()
        .map_err(draw_err)?;
    let policies: Vec<simulate::Policy> = sizes
        .first()
        .map(|s| s.results.iter().map(|x| x.policy).collect())
        .unwrap_or_default();
    for p in &policies {
        let colour = policy_colour(*p);
        let points: Vec<(SegmentValue<u32>, f64)> = sizes
            .iter()
            .enumerate()
            .filter_map(|(at, s)| {
                let x = s.results.iter().find(|x| x.policy == *p)?;
                Some((SegmentValue::CenterOf(at as u32), 100.0 * x.hit_rate))
            })
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))
            .map_err(draw_err)?
            .label(p.name())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
            });
        chart
            .draw_series(
                points
                    .into_iter()
                    .map(|pt| Circle::new(pt, 4, colour.filled())),
            )
            .map_err(draw_err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font((FONT_NAME, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(draw_err)?;
    root.present().map_err(draw_err)
}

/// What to draw.
pub enum Picture<'a> {
    /// The heat map.
    Heat(&'a Heat),
    /// The hit-rate curve.
    Curve(&'a SimReport),
}

/// Renders `picture` as an image of `width` x `height` pixels in `format`.
pub fn render(picture: &Picture<'_>, format: Format, width: u32, height: u32) -> Result<Vec<u8>> {
    if !SIDE.contains(&width) || !SIDE.contains(&height) {
        bail!(
            "an image of {width} x {height} pixels: each side must be between {} and {}",
            SIDE.start(),
            SIDE.end()
        );
    }
    register_font()?;
    match format {
        Format::Svg => {
            let mut s = String::new();
            {
                let root = SVGBackend::with_string(&mut s, (width, height)).into_drawing_area();
                match picture {
                    Picture::Heat(h) => draw_heat(&root, h)?,
                    Picture::Curve(r) => draw_curve(&root, r)?,
                }
            }
            Ok(s.into_bytes())
        }
        Format::Png => {
            let mut rgb = vec![0u8; width as usize * height as usize * 3];
            {
                let root =
                    BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area();
                match picture {
                    Picture::Heat(h) => draw_heat(&root, h)?,
                    Picture::Curve(r) => draw_curve(&root, r)?,
                }
            }
            let mut out = Vec::new();
            let mut enc = png::Encoder::new(&mut out, width, height);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            let mut writer = enc.write_header().context("cannot encode the PNG")?;
            writer
                .write_image_data(&rgb)
                .context("cannot encode the PNG")?;
            writer.finish().context("cannot encode the PNG")?;
            Ok(out)
        }
    }
}

/// `coli trace plot`.
pub fn run(args: &PlotArgs) -> Result<String> {
    let format = Format::of(&args.output)?;
    let sim_only = args.sim.history.is_some()
        || args.sim.train_frac.is_some()
        || !args.sim.policies.is_empty()
        || args.sim.include_prefill;
    let bytes = if args.hit_curve {
        if !is_trace(&args.input)? {
            bail!(
                "{}: --hit-curve replays a trace, and this is a history",
                args.input.display()
            );
        }
        let report = simulate::simulate(&args.input, &args.sim)?;
        render(&Picture::Curve(&report), format, args.width, args.height)?
    } else {
        if sim_only {
            bail!(
                "--policy, --history, --train-frac and --include-prefill apply to --hit-curve only"
            );
        }
        let heat = heat_of(&args.input)?;
        render(&Picture::Heat(&heat), format, args.width, args.height)?
    };
    super::write_output(&args.output, "a PNG or SVG image", is_image, &bytes)?;
    Ok(format!(
        "{} x {} {} -> {}",
        args.width,
        args.height,
        if args.hit_curve {
            "hit-rate curve"
        } else {
            "heat map"
        },
        args.output.display()
    ))
}

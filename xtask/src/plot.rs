//! PNG plots of the benchmark results (plotters, bitmap backend), drawn
//! with Debian's DejaVu Sans (fonts-dejavu-core, installed by setup).
use anyhow::{Context, Result};
use plotters::prelude::*;
use serde_json::Value;
use std::path::Path;

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

fn register_font() -> Result<()> {
    let bytes = std::fs::read(FONT).with_context(|| format!("reading {FONT}"))?;
    // The font lives for the whole program, as plotters requires.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("{FONT} is not a usable font"))
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

const CASES: [(&str, RGBColor); 8] = [
    ("baseline_again", RGBColor(150, 150, 150)),
    ("baseline_conntrack", RGBColor(90, 90, 90)),
    ("nft", BLUE),
    ("ebpf", GREEN),
    ("ebpf_fast", RGBColor(0, 120, 0)),
    ("ebpf_xdp", RGBColor(0, 200, 160)),
    ("conntrack_dnat", RED),
    ("kube_proxy", RGBColor(200, 120, 0)),
];

/// Bars: each case's median as a ratio to the baseline (offloads on), for
/// packet rate and throughput, both directions; `baseline_again` is the
/// A/A control. The line is the baseline (1.0).
pub fn datapath(d: &Value, out: &Path) -> Result<()> {
    register_font()?;
    let r = &d["datapath"]["offloads_on"];
    let groups = [
        ("pps_one_flow", "ingress", "64B 1 flow in"),
        ("pps_one_flow", "egress", "64B 1 flow out"),
        ("pps_many_flows", "ingress", "64B many in"),
        ("pps_many_flows", "egress", "64B many out"),
        ("tcp_gbps", "ingress", "TCP in"),
        ("tcp_gbps", "egress", "TCP out"),
    ];
    let ratio = |case: &str, dir: &str, key: &str| {
        f(&r[case][dir][key]["median"]) / f(&r["baseline"][dir][key]["median"])
    };
    let top = groups
        .iter()
        .flat_map(|(k, dir, _)| CASES.iter().map(move |(c, _)| (c, dir, k)))
        .map(|(c, dir, k)| ratio(c, dir, k))
        .filter(|x| x.is_finite())
        .fold(1.0f64, f64::max)
        + 0.25;
    let root = BitMapBackend::new(out, (1100, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Datapath (offloads on): median / no-NAT baseline, same run",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..(groups.len() as f64 + 1.2), -0.08f64..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("ratio to baseline")
        .label_style(("sans-serif", 14))
        .draw()?;
    let width = 0.8 / CASES.len() as f64;
    for (g, (key, dir, label)) in groups.iter().enumerate() {
        for (i, (case, color)) in CASES.iter().enumerate() {
            let v = ratio(case, dir, key);
            if !v.is_finite() {
                // A case this run did not measure.
                continue;
            }
            let x0 = g as f64 + 0.1 + i as f64 * width;
            chart.draw_series(std::iter::once(Rectangle::new(
                [(x0, 0.0), (x0 + width * 0.9, v)],
                color.filled(),
            )))?;
            chart.draw_series(std::iter::once(Text::new(
                format!("{v:.2}"),
                (x0, v + 0.03),
                ("sans-serif", 10),
            )))?;
        }
        chart.draw_series(std::iter::once(Text::new(
            label.to_string(),
            (g as f64 + 0.1, -0.03),
            ("sans-serif", 13).into_font().color(&BLACK),
        )))?;
    }
    chart.draw_series(LineSeries::new(
        [(0.0, 1.0), (groups.len() as f64, 1.0)],
        BLACK.stroke_width(1),
    ))?;
    let x = groups.len() as f64 + 0.05;
    for (i, (case, color)) in CASES.iter().enumerate() {
        let y = top - 0.1 - i as f64 * (top / 14.0);
        chart.draw_series(std::iter::once(Rectangle::new(
            [(x, y - 0.02), (x + 0.1, y + 0.02)],
            color.filled(),
        )))?;
        chart.draw_series(std::iter::once(Text::new(
            case.to_string(),
            (x + 0.14, y + 0.03),
            ("sans-serif", 13),
        )))?;
    }
    root.present()?;
    Ok(())
}

/// Lines, log-log: Services against one-change time (incremental) and the
/// rebuild peer, per backend; and the initial sync.
pub fn control_plane(c: &Value, out: &Path) -> Result<()> {
    register_font()?;
    let rows: Vec<&Value> = c["control_plane"]
        .as_array()
        .context("control_plane")?
        .iter()
        .collect();
    let root = BitMapBackend::new(out, (900, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Control plane: time to apply, by number of Services",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (50f64..100_000f64).log_scale(),
            (0.01f64..10_000f64).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc("managed Services")
        .y_desc("milliseconds")
        .label_style(("sans-serif", 14))
        .draw()?;
    let series = [
        ("nft", "one_change_median_ms", "nft one change", BLUE),
        ("nft", "rebuild_median_ms", "nft rebuild peer", CYAN),
        (
            "nft",
            "initial_sync_ms",
            "nft full sync",
            RGBColor(100, 100, 255),
        ),
        ("ebpf", "one_change_median_ms", "ebpf one change", GREEN),
        ("ebpf", "rebuild_median_ms", "ebpf rebuild peer", MAGENTA),
        (
            "ebpf",
            "initial_sync_ms",
            "ebpf full sync",
            RGBColor(0, 100, 0),
        ),
    ];
    for (backend, key, label, color) in series {
        let points: Vec<(f64, f64)> = rows
            .iter()
            .map(|r| (f(&r["services"]), f(&r[backend]["apply"][key])))
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(
            points
                .into_iter()
                .map(|p| Circle::new(p, 3, color.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    root.present()?;
    Ok(())
}

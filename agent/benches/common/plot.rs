//! Line charts of a metric against wall time, one panel per scenario, as SVG (plotters, with
//! the DejaVu font embedded as the broker's charts do, so no font library is needed).

use plotters::prelude::*;
use plotters::style::FontStyle;

const FONT: &str = "dejavu-sans";
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// One line: its label and its (x, y) points.
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One panel: its title and its lines.
pub struct Panel {
    pub title: String,
    pub lines: Vec<Line>,
}

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
        let _ = plotters::style::register_font(FONT, FontStyle::Bold, dejavu::sans::bold());
    });
}

/// Writes `panels` side by side in rows of `columns` to `path` (SVG).
pub fn panels(
    path: &std::path::Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    columns: usize,
    legend_at_top: bool,
    panels: &[Panel],
) -> Result<(), String> {
    register_font();
    let columns = columns.max(1);
    let rows = panels.len().div_ceil(columns).max(1);
    let size = (520 * columns as u32, 380 * rows as u32 + 40);
    let failed = |e: &dyn std::fmt::Display| format!("cannot draw {}: {e}", path.display());
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| failed(&e))?;
    let root = root
        .titled(title, (FONT, 20).into_font().style(FontStyle::Bold))
        .map_err(|e| failed(&e))?;
    for (area, panel) in root.split_evenly((rows, columns)).iter().zip(panels) {
        let points = panel.lines.iter().flat_map(|l| l.points.iter());
        let (mut x_max, mut y_min, mut y_max) = (1.0f64, f64::INFINITY, f64::NEG_INFINITY);
        for &(x, y) in points {
            x_max = x_max.max(x);
            y_min = y_min.min(y);
            y_max = y_max.max(y);
        }
        if !y_min.is_finite() {
            (y_min, y_max) = (0.0, 1.0);
        }
        let pad = ((y_max - y_min) * 0.05).max(1e-3);
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, (FONT, 15))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(55)
            .build_cartesian_2d(0.0..x_max * 1.02, (y_min - pad)..(y_max + pad))
            .map_err(|e| failed(&e))?;
        chart
            .configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .label_style((FONT, 12))
            .draw()
            .map_err(|e| failed(&e))?;
        for (i, line) in panel.lines.iter().enumerate() {
            let colour = PALETTE[i % PALETTE.len()];
            chart
                .draw_series(LineSeries::new(
                    line.points.iter().copied(),
                    colour.stroke_width(2),
                ))
                .map_err(|e| failed(&e))?
                .label(line.label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font((FONT, 12))
            .position(if legend_at_top {
                SeriesLabelPosition::UpperRight
            } else {
                SeriesLabelPosition::LowerRight
            })
            .draw()
            .map_err(|e| failed(&e))?;
    }
    root.present().map_err(|e| failed(&e))
}

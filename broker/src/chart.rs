//! Charts of the market, drawn with `plotters`: one implementation for the demo's files, the
//! dashboard's pictures and PNGs for terminals and reports.
//!
//! - [`job_chart`]: a job's life on the market — the spot price of each market it used against
//!   the bids it placed there (and the on-demand price), or, on an availability market where
//!   prices decide nothing, each pool's spot capacity — above the number of instances per tier.
//! - [`price_chart`]: the spot price history of some markets over a window.
//!
//! Each chart is laid out once (steps, scales, legend: the `*Data` structs) and drawn on the
//! backend the [`Format`] asks for. Text is measured with the DejaVu Sans font embedded in the
//! binary (plotters' `ab_glyph` feature), so PNGs need no font library on the machine.

use crate::market::{Market, Timestamp, UsdPerHour};
use crate::prices::PriceHistory;
use crate::sim::availability::Availability;
use crate::store::InstanceRow;
use plotters::coord::Shift;
use plotters::prelude::*;
use proteus_wire::Tier;
use std::collections::BTreeMap;

const WIDTH: u32 = 1000;
const HEIGHT: u32 = 550;
/// Width of the y-label area left of the panels.
const LEFT: u32 = 70;
/// Width of the legend column right of the panels.
const LEGEND: u32 = 200;
const FONT: &str = "sans-serif";
const COLOURS: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x17, 0xbe, 0xcf),
];
const GREY: RGBColor = RGBColor(0x44, 0x44, 0x44);
const LIGHT: RGBColor = RGBColor(0x66, 0x66, 0x66);
const RELIABLE: RGBColor = RGBColor(0x33, 0x33, 0x33);
const MESH: RGBColor = RGBColor(0xe6, 0xe6, 0xe6);
const LEAVING: RGBColor = RGBColor(0xff, 0x7f, 0x0e);

/// What a chart is rendered as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Svg,
    Png,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Svg => "image/svg+xml",
            Format::Png => "image/png",
        }
    }

    /// `svg` or `png` (a file extension or a query parameter).
    pub fn parse(text: &str) -> Option<Format> {
        match text.to_ascii_lowercase().as_str() {
            "svg" => Some(Format::Svg),
            "png" => Some(Format::Png),
            _ => None,
        }
    }
}

/// Drawing or encoding failed (a backend error; the data cannot cause one).
#[derive(Debug, thiserror::Error)]
#[error("drawing the chart: {0}")]
pub struct ChartError(String);

/// A job's chart over `[from, to]`, as `format`.
pub fn job_chart(
    format: Format,
    title: &str,
    history: &PriceHistory,
    availability: Option<&Availability>,
    instances: &[InstanceRow],
    from: Timestamp,
    to: Timestamp,
) -> Result<Vec<u8>, ChartError> {
    let mut data = JobChartData::new(title, history, instances, from, to);
    if let Some(a) = availability {
        data.capacity = Some(CapacityPanel::new(a, instances, data.axis));
    }
    render(format, &data)
}

/// The spot price of `markets` over `[from, to]`, with their on-demand prices where they fit
/// the scale, as `format`.
pub fn price_chart(
    format: Format,
    title: &str,
    history: &PriceHistory,
    markets: &[Market],
    from: Timestamp,
    to: Timestamp,
) -> Result<Vec<u8>, ChartError> {
    render(
        format,
        &PriceChartData::new(title, history, markets, from, to),
    )
}

type Drawn<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// A laid-out chart that can draw itself on any plotters backend.
trait Chart {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Drawn<DB>;
}

fn render(format: Format, chart: &impl Chart) -> Result<Vec<u8>, ChartError> {
    register_font();
    let failed = |e: &dyn std::fmt::Display| ChartError(e.to_string());
    match format {
        Format::Svg => {
            let mut svg = String::new();
            {
                let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
                chart.draw(&root).map_err(|e| failed(&e))?;
                root.present().map_err(|e| failed(&e))?;
            }
            Ok(svg.into_bytes())
        }
        Format::Png => {
            let mut rgb = vec![0u8; (WIDTH * HEIGHT * 3) as usize];
            {
                let root =
                    BitMapBackend::with_buffer(&mut rgb, (WIDTH, HEIGHT)).into_drawing_area();
                chart.draw(&root).map_err(|e| failed(&e))?;
                root.present().map_err(|e| failed(&e))?;
            }
            let mut png = Vec::new();
            image::ImageEncoder::write_image(
                image::codecs::png::PngEncoder::new(&mut png),
                &rgb,
                WIDTH,
                HEIGHT,
                image::ColorType::Rgb8,
            )
            .map_err(|e| failed(&e))?;
            Ok(png)
        }
    }
}

/// Registers the embedded font under the family name every chart uses (once per process).
fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Both are valid TrueType files shipped by the `dejavu` crate; a failure would only
        // leave text unmeasured, which plotters reports as a drawing error.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
        let _ = plotters::style::register_font(FONT, FontStyle::Bold, dejavu::sans::bold());
    });
}

/// A price (or count) that holds from one time to the next, as the corner points of a step line
/// in chart coordinates (hours since the chart's start).
fn steps(
    start: Option<f64>,
    changes: impl Iterator<Item = (f64, f64)>,
    end: f64,
) -> Vec<(f64, f64)> {
    let mut points = Vec::new();
    let mut last = start;
    if let Some(v) = start {
        points.push((0.0, v));
    }
    for (x, v) in changes {
        if let Some(prev) = last {
            points.push((x, prev));
        }
        points.push((x, v));
        last = Some(v);
    }
    if let Some(v) = last {
        points.push((end, v));
    }
    // A change at the window's start repeats the price in force there.
    points.dedup();
    points
}

/// A market's spot price over the window, and its on-demand price.
struct MarketLine {
    name: String,
    colour: RGBColor,
    points: Vec<(f64, f64)>,
    on_demand: Option<f64>,
}

/// The time axis: hours since `from`, labelled in market time (UTC).
#[derive(Clone, Copy)]
struct TimeAxis {
    from: Timestamp,
    to: Timestamp,
}

impl TimeAxis {
    fn new(from: Timestamp, to: Timestamp) -> Self {
        let to = if to <= from {
            from.plus_secs(3600.0)
        } else {
            to
        };
        TimeAxis { from, to }
    }
    fn hours(&self) -> f64 {
        self.to.secs_since(self.from) / 3600.0
    }
    fn x(&self, t: Timestamp) -> f64 {
        (t.secs_since(self.from) / 3600.0).clamp(0.0, self.hours())
    }
    fn label(&self, x: f64) -> String {
        let fmt = if self.hours() > 72.0 {
            "%m-%d"
        } else {
            "%m-%d %H:%M"
        };
        self.from
            .plus_secs(x * 3600.0)
            .to_datetime()
            .format(fmt)
            .to_string()
    }
}

fn market_lines<'a>(
    history: &PriceHistory,
    markets: impl Iterator<Item = &'a Market>,
    axis: TimeAxis,
) -> Vec<MarketLine> {
    markets
        .enumerate()
        .map(|(k, m)| {
            let points = history
                .get(m)
                .map(|s| {
                    let (times, prices) = s.window(axis.from, axis.to);
                    steps(
                        s.price_at(axis.from).map(UsdPerHour::get),
                        times.iter().map(|t| axis.x(*t)).zip(prices.iter().copied()),
                        axis.hours(),
                    )
                })
                .unwrap_or_default();
            MarketLine {
                name: m.to_string(),
                colour: COLOURS[k % COLOURS.len()],
                points,
                on_demand: history.on_demand().for_market(m).map(|o| o.on_demand.get()),
            }
        })
        .collect()
}

/// The price axis: logarithmic, from a little under the lowest price in view to a little over
/// the highest, on-demand prices and bids included. On a log scale a market that spikes a
/// hundredfold takes two decades of the panel instead of flattening the others to its floor,
/// and the on-demand price (usually far above spot) is always drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PriceScale {
    lo: f64,
    hi: f64,
}

impl PriceScale {
    fn of(prices: impl Iterator<Item = f64>) -> PriceScale {
        let (lo, hi) = prices
            .filter(|p| p.is_finite() && *p > 0.0)
            .fold((f64::INFINITY, 0.0f64), |(lo, hi), p| {
                (lo.min(p), hi.max(p))
            });
        if hi <= 0.0 {
            return PriceScale { lo: 0.01, hi: 1.0 };
        }
        // At least a factor of 2 from floor to ceiling, so a flat price is not a line on the
        // frame.
        let lo = (lo * 0.8).min(hi / 2.0);
        PriceScale { lo, hi: hi * 1.25 }
    }

    /// The panel's y range: prices are drawn at their decimal logarithm on a linear axis
    /// (plotters' own log axis labels only powers of ten, so a panel between two of them would
    /// have no label at all), and the labels turn them back into dollars.
    fn range(self) -> std::ops::Range<f64> {
        self.lo.log10()..self.hi.log10()
    }
}

/// Where a price goes on a [`PriceScale`] panel.
fn y(price: f64) -> f64 {
    price.max(f64::MIN_POSITIVE).log10()
}

/// A price label with the digits its size needs.
fn price_label(v: f64) -> String {
    match v {
        v if v >= 10.0 => format!("${v:.1}"),
        v if v >= 1.0 => format!("${v:.2}"),
        v if v >= 0.01 => format!("${v:.3}"),
        v => format!("${v:.4}"),
    }
}

/// A bid held from launch to end; `evicted` marks the end with a dot.
struct BidLine {
    colour: RGBColor,
    bid: f64,
    from: f64,
    to: f64,
    evicted: bool,
}

/// Each pool's spot capacity over the window (an availability market), with the job's
/// interruptions marked on their pool's line.
struct CapacityPanel {
    pools: Vec<MarketLine>,
    /// Interrupted spot instances: where they ended, and their pool's colour.
    interruptions: Vec<(f64, f64, RGBColor)>,
    max: f64,
}

impl CapacityPanel {
    fn new(a: &Availability, instances: &[InstanceRow], axis: TimeAxis) -> Self {
        let pools: Vec<MarketLine> = a
            .markets()
            .enumerate()
            .map(|(k, m)| {
                let (first, changes) = a.capacity_changes(m, axis.from, axis.to);
                MarketLine {
                    name: m.zone.to_string(),
                    colour: COLOURS[k % COLOURS.len()],
                    points: steps(
                        Some(f64::from(first)),
                        changes.into_iter().map(|(t, c)| (axis.x(t), f64::from(c))),
                        axis.hours(),
                    ),
                    on_demand: None,
                }
            })
            .collect();
        let interruptions = instances
            .iter()
            .filter(|i| i.tier == Tier::Transient && i.ended_by_provider)
            .filter_map(|i| {
                let end = i.ended?;
                let k = a.markets().position(|m| m.zone == i.market.zone)?;
                Some((
                    axis.x(end),
                    f64::from(a.capacity(&i.market, end)),
                    pools[k].colour,
                ))
            })
            .collect();
        let max = pools
            .iter()
            .flat_map(|p| p.points.iter().map(|q| q.1))
            .fold(1.0, f64::max);
        CapacityPanel {
            pools,
            interruptions,
            max,
        }
    }
}

/// Everything [`job_chart`] draws, computed from the job's instances and the price history.
struct JobChartData {
    title: String,
    axis: TimeAxis,
    markets: Vec<MarketLine>,
    bids: Vec<BidLine>,
    prices: PriceScale,
    /// Step lines of the live count: reliable and transient instances that stay, and warned
    /// instances of either tier still running until they leave.
    tiers: [Vec<(f64, f64)>; 3],
    max_count: i32,
    /// On an availability market: drawn in place of prices and bids.
    capacity: Option<CapacityPanel>,
}

impl JobChartData {
    fn new(
        title: &str,
        history: &PriceHistory,
        instances: &[InstanceRow],
        from: Timestamp,
        to: Timestamp,
    ) -> Self {
        let axis = TimeAxis::new(from, to);
        let mut markets: Vec<&Market> = instances
            .iter()
            .filter(|i| i.tier == Tier::Transient)
            .map(|i| &i.market)
            .collect();
        markets.sort();
        markets.dedup();
        let lines = market_lines(history, markets.iter().copied(), axis);
        let mut bids = Vec::new();
        for i in instances {
            if let (Some(bid), Some(launched)) = (i.bid, i.launched)
                && let Some(k) = markets.iter().position(|m| *m == &i.market)
            {
                bids.push(BidLine {
                    colour: lines[k].colour,
                    bid: bid.get(),
                    from: axis.x(launched),
                    to: axis.x(i.ended.unwrap_or(axis.to)),
                    evicted: i.ended_by_provider,
                });
            }
        }
        let prices = PriceScale::of(
            lines
                .iter()
                .flat_map(|l| l.points.iter().map(|p| p.1).chain(l.on_demand))
                .chain(instances.iter().filter_map(|i| i.bid.map(|b| b.get()))),
        );

        // Instances over time, as steps: per tier while they stay; a warned instance moves to
        // the leaving line until it ends (as status counts it: over the limits for a while).
        let mut changes: BTreeMap<Timestamp, [i32; 3]> = BTreeMap::new();
        for i in instances {
            let Some(launched) = i.launched else { continue };
            let k = usize::from(i.tier != Tier::Reliable);
            changes.entry(launched.max(from)).or_default()[k] += 1;
            let leaving = i.warned.filter(|w| i.ended.is_none_or(|e| *w < e));
            if let Some(warned) = leaving {
                let at = changes.entry(warned.max(from)).or_default();
                at[k] -= 1;
                at[2] += 1;
            }
            if let Some(end) = i.ended {
                let k = if leaving.is_some() { 2 } else { k };
                changes.entry(end.max(from)).or_default()[k] -= 1;
            }
        }
        let mut level = [0i32; 3];
        let mut tiers: [Vec<(f64, f64)>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        let mut max_count = 1;
        for (k, series) in tiers.iter_mut().enumerate() {
            level[k] = 0;
            *series = steps(
                Some(0.0),
                changes.iter().map(|(t, d)| {
                    level[k] += d[k];
                    max_count = max_count.max(level[k]);
                    (axis.x(*t), f64::from(level[k]))
                }),
                axis.hours(),
            );
        }
        JobChartData {
            title: title.to_string(),
            axis,
            markets: lines,
            bids,
            prices,
            tiers,
            max_count,
            capacity: None,
        }
    }
}

impl Chart for JobChartData {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Drawn<DB> {
        canvas(root, &self.title)?;
        let (prices, counts) = root.split_vertically(340);
        let (price_plot, _) = prices.split_horizontally(WIDTH - LEGEND);
        let hours = self.axis.hours();

        if let Some(cap) = &self.capacity {
            // Each pool's capacity: what decides a launch and an interruption on this market.
            price_plot.draw(&Text::new(
                "spot instances each pool would sell (capacity); ◉ an interruption of the job's",
                (LEFT as i32, 34),
                text(12, GREY),
            ))?;
            let mut chart = ChartBuilder::on(&price_plot)
                .margin_top(50)
                .margin_right(10)
                .y_label_area_size(LEFT)
                .build_cartesian_2d(0.0..hours, 0.0..cap.max * 1.1)?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .bold_line_style(MESH)
                .light_line_style(WHITE)
                .x_labels(0)
                .y_labels(6)
                .y_label_formatter(&|v| format!("{v:.0}"))
                .label_style(text(12, GREY))
                .draw()?;
            for p in &cap.pools {
                chart.draw_series(LineSeries::new(
                    p.points.iter().copied(),
                    p.colour.stroke_width(2),
                ))?;
            }
            for &(x, c, colour) in &cap.interruptions {
                chart.draw_series([
                    Circle::new((x, c), 8, BLACK.stroke_width(2)),
                    Circle::new((x, c), 6, colour.filled()),
                ])?;
            }
            for (row, p) in cap.pools.iter().enumerate() {
                legend(root, 50, row, Swatch::Line(p.colour), &p.name)?;
            }
            legend(root, 50, cap.pools.len(), Swatch::None, "◉ interruption")?;
            return self.draw_counts(root, counts);
        }

        // Spot prices, bids and on-demand prices.
        price_plot.draw(&Text::new(
            "spot price (solid), bids (dashed), on-demand (dotted), USD/h, log scale",
            (LEFT as i32, 34),
            text(12, GREY),
        ))?;
        let mut chart = ChartBuilder::on(&price_plot)
            .margin_top(50)
            .margin_right(10)
            .y_label_area_size(LEFT)
            .build_cartesian_2d(0.0..hours, self.prices.range())?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .bold_line_style(MESH)
            .light_line_style(WHITE)
            .x_labels(0)
            .y_labels(6)
            .y_label_formatter(&|v| price_label(10f64.powf(*v)))
            .label_style(text(12, GREY))
            .draw()?;
        for m in &self.markets {
            chart.draw_series(LineSeries::new(
                m.points.iter().map(|&(x, p)| (x, y(p))),
                m.colour.stroke_width(2),
            ))?;
            if let Some(od) = m.on_demand {
                chart.draw_series(DashedLineSeries::new(
                    [(0.0, y(od)), (hours, y(od))],
                    2,
                    3,
                    m.colour.mix(0.6).stroke_width(1),
                ))?;
            }
        }
        for b in &self.bids {
            chart.draw_series(DashedLineSeries::new(
                [(b.from, y(b.bid)), (b.to, y(b.bid))],
                6,
                3,
                b.colour.stroke_width(2),
            ))?;
        }
        // Evictions on top of every line: a dot in the market's colour inside a dark ring.
        for b in self.bids.iter().filter(|b| b.evicted) {
            chart.draw_series([
                Circle::new((b.to, y(b.bid)), 8, BLACK.stroke_width(2)),
                Circle::new((b.to, y(b.bid)), 6, b.colour.filled()),
            ])?;
        }
        let mut row = 0;
        for m in &self.markets {
            legend(root, 50, row, Swatch::Line(m.colour), &m.name)?;
            row += 1;
        }
        legend(root, 50, row, Swatch::None, "◉ eviction")?;
        self.draw_counts(root, counts)
    }
}

impl JobChartData {
    /// The lower panel: instances per tier.
    fn draw_counts<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
        counts: DrawingArea<DB, Shift>,
    ) -> Drawn<DB> {
        let (count_plot, _) = counts.split_horizontally(WIDTH - LEGEND);
        let hours = self.axis.hours();
        count_plot.draw(&Text::new(
            "instances per tier",
            (LEFT as i32, 4),
            text(12, GREY),
        ))?;
        let axis = self.axis;
        let mut chart = ChartBuilder::on(&count_plot)
            .margin_top(20)
            .margin_right(10)
            .y_label_area_size(LEFT)
            .x_label_area_size(45)
            .build_cartesian_2d(0.0..hours, 0.0..f64::from(self.max_count) * 1.1)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .bold_line_style(MESH)
            .light_line_style(WHITE)
            .x_labels(5)
            .x_label_formatter(&|x| axis.label(*x))
            .y_labels(self.max_count as usize + 1)
            .y_label_formatter(&|v| format!("{v:.0}"))
            .x_desc("market time (UTC)")
            .label_style(text(12, GREY))
            .axis_desc_style(text(12, GREY))
            .draw()?;
        for (k, (name, colour)) in [
            ("on-demand (reliable)", RELIABLE),
            ("spot (transient)", COLOURS[0]),
            ("leaving (warned)", LEAVING),
        ]
        .into_iter()
        .enumerate()
        {
            chart.draw_series(LineSeries::new(
                self.tiers[k].iter().copied(),
                colour.stroke_width(2),
            ))?;
            legend(root, 340 + 20, k, Swatch::Line(colour), name)?;
        }
        Ok(())
    }
}

/// Everything [`price_chart`] draws.
struct PriceChartData {
    title: String,
    axis: TimeAxis,
    markets: Vec<MarketLine>,
    prices: PriceScale,
}

impl PriceChartData {
    fn new(
        title: &str,
        history: &PriceHistory,
        markets: &[Market],
        from: Timestamp,
        to: Timestamp,
    ) -> Self {
        let axis = TimeAxis::new(from, to);
        let lines = market_lines(history, markets.iter(), axis);
        let prices = PriceScale::of(
            lines
                .iter()
                .flat_map(|l| l.points.iter().map(|p| p.1).chain(l.on_demand)),
        );
        PriceChartData {
            title: title.to_string(),
            axis,
            markets: lines,
            prices,
        }
    }
}

impl Chart for PriceChartData {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Drawn<DB> {
        canvas(root, &self.title)?;
        let (plot, _) = root.split_horizontally(WIDTH - LEGEND);
        plot.draw(&Text::new(
            "spot price (solid), on-demand (dotted), USD/h, log scale",
            (LEFT as i32, 34),
            text(12, GREY),
        ))?;
        let axis = self.axis;
        let hours = axis.hours();
        let mut chart = ChartBuilder::on(&plot)
            .margin_top(50)
            .margin_right(10)
            .y_label_area_size(LEFT)
            .x_label_area_size(45)
            .build_cartesian_2d(0.0..hours, self.prices.range())?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .bold_line_style(MESH)
            .light_line_style(WHITE)
            .x_labels(5)
            .x_label_formatter(&|x| axis.label(*x))
            .y_labels(6)
            .y_label_formatter(&|v| price_label(10f64.powf(*v)))
            .x_desc("market time (UTC)")
            .label_style(text(12, GREY))
            .axis_desc_style(text(12, GREY))
            .draw()?;
        for (k, m) in self.markets.iter().enumerate() {
            chart.draw_series(LineSeries::new(
                m.points.iter().map(|&(x, p)| (x, y(p))),
                m.colour.stroke_width(2),
            ))?;
            if let Some(od) = m.on_demand {
                chart.draw_series(DashedLineSeries::new(
                    [(0.0, y(od)), (hours, y(od))],
                    2,
                    3,
                    m.colour.mix(0.6).stroke_width(1),
                ))?;
            }
            legend(root, 50, k, Swatch::Line(m.colour), &m.name)?;
        }
        if self.markets.iter().all(|m| m.points.is_empty()) {
            plot.draw(&Text::new(
                "no prices recorded in this window",
                (LEFT as i32 + 20, 80),
                text(14, LIGHT),
            ))?;
        }
        Ok(())
    }
}

fn text(size: u32, colour: RGBColor) -> TextStyle<'static> {
    (FONT, size).into_font().color(&colour)
}

/// A white canvas with the chart's title at its top left.
fn canvas<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, title: &str) -> Drawn<DB> {
    root.fill(&WHITE)?;
    root.draw(&Text::new(
        title.to_string(),
        (LEFT as i32, 12),
        (FONT, 16).into_font().style(FontStyle::Bold).color(&BLACK),
    ))
}

/// What a legend entry shows before its label.
enum Swatch {
    None,
    /// A line's colour.
    Line(RGBColor),
    /// A bar's colour.
    Block(RGBColor),
}

/// The `row`th entry of the legend column right of the panel that starts at `top`: a swatch (if
/// any) and a label.
fn legend<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    top: i32,
    row: usize,
    swatch: Swatch,
    label: &str,
) -> Drawn<DB> {
    let x = (WIDTH - LEGEND) as i32 + 12;
    let y = top + 14 + 16 * row as i32;
    let label_x = match swatch {
        Swatch::Line(colour) => {
            root.draw(&PathElement::new(
                vec![(x, y - 4), (x + 18, y - 4)],
                colour.stroke_width(2),
            ))?;
            x + 24
        }
        Swatch::Block(colour) => {
            root.draw(&Rectangle::new([(x, y - 10), (x + 18, y)], colour.filled()))?;
            x + 24
        }
        Swatch::None => x,
    };
    root.draw(&Text::new(
        label.to_string(),
        (label_x, y - 11),
        text(12, BLACK),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::market::UsdPerHour;
    use crate::prices::{OnDemandCatalog, PriceSeries};
    use crate::store::InstanceState;

    fn one_evicted_instance() -> (PriceHistory, InstanceRow) {
        let m = Market::parse("us-east-1a/c3.xlarge").unwrap();
        let p = |v| UsdPerHour::new(v).unwrap();
        let series = PriceSeries::new(
            m.clone(),
            vec![
                (Timestamp::from_millis(0), p(0.05)),
                (Timestamp::from_millis(1_800_000), p(0.3)),
            ],
        );
        let history = PriceHistory::new(vec![series], OnDemandCatalog::default());
        let inst = InstanceRow {
            id: "pi-1".into(),
            job_id: proteus_wire::JobId(1),
            cloud_id: Some("sim-1".into()),
            market: m,
            tier: Tier::Transient,
            bid: Some(p(0.06)),
            state: InstanceState::Terminated,
            token_hash: String::new(),
            requested: Timestamp::from_millis(0),
            launched: Some(Timestamp::from_millis(0)),
            ready: None,
            warned: None,
            ended: Some(Timestamp::from_millis(1_920_000)),
            end_reason: Some("evicted".into()),
            ended_by_provider: true,
            launch_error: None,
            metadata_addr: None,
            agent_pid: None,
            stop_by: None,
            launch_token: None,
            bootstrap_hash: None,
            bootstrap_used: None,
        };
        (history, inst)
    }

    /// The job chart's data for `inst` over the trace's first hour.
    fn first_hour(history: &PriceHistory, inst: InstanceRow) -> JobChartData {
        JobChartData::new(
            "t",
            history,
            &[inst],
            Timestamp::from_millis(0),
            Timestamp::from_millis(3_600_000),
        )
    }

    /// On an availability market the upper panel shows each pool's capacity, not prices: the
    /// pools are named, an interruption sits on its pool's line at the capacity it dropped to.
    #[test]
    fn an_availability_market_charts_each_pools_capacity_instead_of_prices() {
        use crate::sim::availability::{AvailabilityTrace, Reading};
        let trace = |zone: &str, data: &str| {
            AvailabilityTrace::parse(
                std::path::Path::new(&format!("{zone}_v100_1.json")),
                &format!("{{\"metadata\": {{\"gap_seconds\": 600}}, \"data\": [{data}]}}"),
                Reading::Available,
            )
            .unwrap()
        };
        let a = Availability::new(
            vec![
                trace("us-west-2a", "3,3,3,0,0,2"),
                trace("us-west-2c", "1,1,1,1,1,1"),
            ],
            crate::market::InstanceType::parse("p3.2xlarge").unwrap(),
            Timestamp::from_millis(0),
        )
        .unwrap();
        let (history, mut inst) = one_evicted_instance();
        inst.market = Market::parse("us-west-2a/p3.2xlarge").unwrap();
        inst.bid = None;
        inst.ended = Some(Timestamp::from_millis(1_920_000));
        let panel = CapacityPanel::new(
            &a,
            std::slice::from_ref(&inst),
            TimeAxis::new(Timestamp::from_millis(0), Timestamp::from_millis(3_600_000)),
        );
        let names: Vec<&str> = panel.pools.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["us-west-2a", "us-west-2c"]);
        // 2a: 3 until 30 min, 0 until 50 min, then 2.
        assert_eq!(
            panel.pools[0].points,
            [
                (0.0, 3.0),
                (0.5, 3.0),
                (0.5, 0.0),
                (50.0 / 60.0, 0.0),
                (50.0 / 60.0, 2.0),
                (1.0, 2.0)
            ]
        );
        assert_eq!(panel.interruptions, [(32.0 / 60.0, 0.0, COLOURS[0])]);
        assert_eq!(panel.max, 3.0);
        let svg = job_chart(
            Format::Svg,
            "today",
            &history,
            Some(&a),
            &[inst],
            Timestamp::from_millis(0),
            Timestamp::from_millis(3_600_000),
        )
        .unwrap();
        let svg = String::from_utf8(svg).unwrap();
        assert!(
            svg.contains("capacity") && svg.contains("us-west-2c"),
            "{svg}"
        );
        assert!(!svg.contains("spot price"), "prices decide nothing here");
    }

    #[test]
    fn job_chart_is_well_formed_svg_with_every_market() {
        let (history, inst) = one_evicted_instance();
        let svg = job_chart(
            Format::Svg,
            "t <1>",
            &history,
            None,
            &[inst],
            Timestamp::from_millis(0),
            Timestamp::from_millis(3_600_000),
        )
        .unwrap();
        let svg = String::from_utf8(svg).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("us-east-1a/c3.xlarge"));
        assert!(svg.contains("t &lt;1&gt;"), "the title is escaped");
        assert!(svg.contains("<circle"), "the eviction is marked");
        assert!(svg.contains("instances per tier") && svg.contains("market time (UTC)"));
        // A log scale from under the lowest price ($0.05) to over the highest ($0.30), with
        // labels in dollars between powers of ten as well.
        assert!(svg.contains("log scale"), "{svg}");
        for label in ["$0.063", "$0.100", "$0.251"] {
            assert!(svg.contains(label), "the price axis has {label}: {svg}");
        }
        assert_eq!(svg.matches("<svg").count(), 1);
    }

    #[test]
    fn job_chart_steps_follow_the_price_changes() {
        let axis = TimeAxis::new(Timestamp::from_millis(0), Timestamp::from_millis(3_600_000));
        let points = steps(Some(0.05), [(0.5, 0.3)].into_iter(), axis.hours());
        assert_eq!(
            points,
            vec![(0.0, 0.05), (0.5, 0.05), (0.5, 0.3), (1.0, 0.3)]
        );
        let (history, inst) = one_evicted_instance();
        let data = first_hour(&history, inst);
        assert_eq!(data.markets[0].points, points);
        assert_eq!(data.bids.len(), 1);
        assert!(data.bids[0].evicted && (data.bids[0].to - 1_920.0 / 3_600.0).abs() < 1e-9);
        assert_eq!(data.tiers[1].iter().map(|p| p.1).fold(0.0, f64::max), 1.0);
        // Never warned: it never leaves.
        assert!(
            data.tiers[2].iter().all(|p| p.1 == 0.0),
            "{:?}",
            data.tiers[2]
        );
        assert_eq!(
            data.prices,
            PriceScale {
                lo: 0.05 * 0.8,
                hi: 0.3 * 1.25
            }
        );
    }

    #[test]
    fn a_warned_instance_moves_from_its_tier_to_the_leaving_line_until_it_ends() {
        let (history, mut inst) = one_evicted_instance();
        inst.warned = Some(Timestamp::from_millis(1_800_000));
        let data = first_hour(&history, inst);
        let level = |k: usize, x: f64| {
            data.tiers[k]
                .iter()
                .rev()
                .find(|p| p.0 <= x)
                .map_or(0.0, |p| p.1)
        };
        // Spot until the notice at 0.5 h, leaving until it ends at 0.533 h, then gone.
        assert_eq!((level(1, 0.25), level(2, 0.25)), (1.0, 0.0));
        assert_eq!((level(1, 0.52), level(2, 0.52)), (0.0, 1.0));
        assert_eq!((level(1, 0.9), level(2, 0.9)), (0.0, 0.0));
    }

    #[test]
    fn the_price_scale_spans_every_price_in_view_on_decades() {
        // A spike a hundredfold above the others and an on-demand price far above spot: both
        // in the panel, the floor just under the cheapest price.
        let scale = PriceScale::of([0.032, 0.034, 2.5, 0.21].into_iter());
        assert!((scale.lo - 0.032 * 0.8).abs() < 1e-12 && (scale.hi - 2.5 * 1.25).abs() < 1e-12);
        let share = |a: f64, b: f64| (y(b) - y(a)) / (scale.range().end - scale.range().start);
        // Linear, 0.032 to 0.034 would be 0.06% of the panel; on decades it is 1.3%.
        assert!(share(0.032, 0.034) > 0.012, "{}", share(0.032, 0.034));
        // A flat price is not drawn on the frame; nothing in view gives a default panel.
        let flat = PriceScale::of([0.05, 0.05].into_iter());
        assert!(flat.hi / flat.lo >= 2.0);
        assert_eq!(
            PriceScale::of(std::iter::empty()),
            PriceScale { lo: 0.01, hi: 1.0 }
        );
        assert_eq!(price_label(0.0321), "$0.032");
        assert_eq!(price_label(3.06), "$3.06");
        assert_eq!(price_label(0.00412), "$0.0041");
    }

    #[test]
    fn charts_render_as_png_with_the_embedded_font() {
        let (history, inst) = one_evicted_instance();
        let png = job_chart(
            Format::Png,
            "png",
            &history,
            None,
            std::slice::from_ref(&inst),
            Timestamp::from_millis(0),
            Timestamp::from_millis(3_600_000),
        )
        .unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let img = image::load_from_memory(&png).unwrap();
        assert_eq!((img.width(), img.height()), (WIDTH, HEIGHT));
        // Text and lines were drawn: not a blank white canvas.
        let dark = img
            .to_rgb8()
            .pixels()
            .filter(|p| p.0.iter().all(|c| *c < 128))
            .count();
        assert!(dark > 500, "only {dark} dark pixels");
        let price = price_chart(
            Format::Png,
            "prices",
            &history,
            std::slice::from_ref(&inst.market),
            Timestamp::from_millis(0),
            Timestamp::from_millis(3_600_000),
        )
        .unwrap();
        assert_eq!(&price[..4], b"\x89PNG");
    }
}

/// One series of a bar chart: a value per category.
#[derive(Debug, Clone)]
pub struct BarSeries {
    pub name: String,
    pub values: Vec<f64>,
}

/// Grouped bars: one group per category, one bar per series, on a linear scale through zero.
pub fn bar_chart(
    format: Format,
    title: &str,
    y_label: &str,
    categories: &[String],
    series: &[BarSeries],
) -> Result<Vec<u8>, ChartError> {
    render(
        format,
        &BarChartData {
            title: title.to_string(),
            y_label: y_label.to_string(),
            categories: categories.to_vec(),
            series: series.to_vec(),
        },
    )
}

impl Format {
    /// PNG for a `.png` file, SVG otherwise.
    pub fn from_path(path: &std::path::Path) -> Format {
        path.extension()
            .and_then(|e| e.to_str())
            .and_then(Format::parse)
            .unwrap_or(Format::Svg)
    }
}

struct BarChartData {
    title: String,
    y_label: String,
    categories: Vec<String>,
    series: Vec<BarSeries>,
}

impl Chart for BarChartData {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Drawn<DB> {
        canvas(root, &self.title)?;
        let (plot, _) = root.split_horizontally(WIDTH - LEGEND);
        let values = self.series.iter().flat_map(|s| s.values.iter().copied());
        let (lo, hi) = values.fold((0.0_f64, 0.0_f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
        let pad = ((hi - lo) * 0.08).max(1e-9);
        let n = self.categories.len().max(1) as f64;
        let mut chart = ChartBuilder::on(&plot)
            .margin_top(40)
            .margin_right(10)
            .y_label_area_size(LEFT)
            .x_label_area_size(60)
            .build_cartesian_2d(0.0..n, (lo - pad)..(hi + pad))?;
        let categories = &self.categories;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .bold_line_style(MESH)
            .light_line_style(WHITE)
            .x_labels(categories.len() * 2 + 1)
            .x_label_formatter(&|x| {
                let i = x.floor();
                if (x - i - 0.5).abs() < 0.26 && i >= 0.0 {
                    categories.get(i as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_labels(8)
            .y_desc(self.y_label.clone())
            .label_style(text(11, GREY))
            .axis_desc_style(text(12, GREY))
            .draw()?;
        let k = self.series.len().max(1) as f64;
        let width = 0.8 / k;
        for (j, s) in self.series.iter().enumerate() {
            let colour = COLOURS[j % COLOURS.len()];
            chart.draw_series(s.values.iter().enumerate().map(|(i, &v)| {
                let x0 = i as f64 + 0.1 + width * j as f64;
                Rectangle::new([(x0, 0.0), (x0 + width * 0.9, v)], colour.filled())
            }))?;
            legend(root, 40, j, Swatch::Block(colour), &s.name)?;
        }
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(0.0, 0.0), (n, 0.0)],
            BLACK.stroke_width(1),
        )))?;
        Ok(())
    }
}

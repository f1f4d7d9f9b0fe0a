//! An SVG chart of a job's life on the market: the spot price of each market it used against
//! the bids it placed there (and the on-demand price), above the number of instances per tier.
//! Hand-written SVG: no font or image library, and the file opens in any browser.

use crate::market::{Market, Timestamp};
use crate::prices::PriceHistory;
use crate::store::InstanceRow;
use proteus_wire::Tier;
use std::collections::BTreeMap;
use std::fmt::Write;

const WIDTH: f64 = 1000.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 200.0;
const PRICE_TOP: f64 = 50.0;
const PRICE_HEIGHT: f64 = 260.0;
const COUNT_TOP: f64 = 360.0;
const COUNT_HEIGHT: f64 = 140.0;
const HEIGHT: f64 = 550.0;
const COLOURS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
];

/// Renders the chart of `instances` over `[from, to]`.
pub fn job_chart(
    title: &str,
    history: &PriceHistory,
    instances: &[InstanceRow],
    from: Timestamp,
    to: Timestamp,
) -> String {
    let to = if to <= from {
        from.plus_secs(3600.0)
    } else {
        to
    };
    let x = |t: Timestamp| {
        LEFT + (WIDTH - LEFT - RIGHT) * (t.secs_since(from) / to.secs_since(from)).clamp(0.0, 1.0)
    };

    let mut markets: Vec<&Market> = instances
        .iter()
        .filter(|i| i.tier == Tier::Transient)
        .map(|i| &i.market)
        .collect();
    markets.sort();
    markets.dedup();
    let mut max_price: f64 = 0.0;
    for m in &markets {
        if let Some(s) = history.get(m) {
            let (_, prices) = s.window(from, to);
            max_price = prices
                .iter()
                .copied()
                .chain(s.price_at(from))
                .fold(max_price, f64::max);
        }
    }
    for i in instances {
        if let Some(b) = i.bid {
            max_price = max_price.max(b.get());
        }
    }
    let max_price = if max_price > 0.0 {
        max_price * 1.25
    } else {
        1.0
    };
    let y_price = |p: f64| PRICE_TOP + PRICE_HEIGHT * (1.0 - (p / max_price).clamp(0.0, 1.0));

    let mut svg = String::new();
    let _ = write!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{LEFT}" y="24" font-size="16" font-weight="bold">{}</text>
<text x="{LEFT}" y="{}" fill="#444">spot price (solid), bids (dashed), on-demand (dotted), USD/h</text>
"##,
        escape(title),
        PRICE_TOP - 8.0
    );
    axes(&mut svg, PRICE_TOP, PRICE_HEIGHT, max_price, |v| {
        format!("${v:.3}")
    });

    let mut off_scale: Vec<String> = Vec::new();
    for (k, m) in markets.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        if let Some(series) = history.get(m) {
            let mut path = String::new();
            let mut last = series.price_at(from);
            if let Some(p) = last {
                let _ = write!(path, "M{:.1},{:.1}", x(from), y_price(p));
            }
            let (times, prices) = series.window(from, to);
            for (t, p) in times.iter().zip(prices) {
                match last {
                    Some(prev) => {
                        let _ = write!(
                            path,
                            " L{:.1},{:.1} L{:.1},{:.1}",
                            x(*t),
                            y_price(prev),
                            x(*t),
                            y_price(*p)
                        );
                    }
                    None => {
                        let _ = write!(path, "M{:.1},{:.1}", x(*t), y_price(*p));
                    }
                }
                last = Some(*p);
            }
            if let Some(p) = last {
                let _ = write!(path, " L{:.1},{:.1}", x(to), y_price(p));
            }
            let _ = writeln!(
                svg,
                r#"<path d="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>"#
            );
        }
        // On-demand is usually far above spot; drawn only when it fits, otherwise named.
        if let Some(o) = history.on_demand().for_market(m) {
            let od = o.on_demand.get();
            if od <= max_price {
                let y = y_price(od);
                let _ = writeln!(
                    svg,
                    r#"<line x1="{LEFT}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="{colour}" stroke-dasharray="2,3" opacity="0.6"/>"#,
                    WIDTH - RIGHT
                );
            } else {
                off_scale.push(format!("on-demand {} ${od:.3}/h ↑", m.instance_type));
            }
        }
        for i in instances.iter().filter(|i| &i.market == *m) {
            if let (Some(bid), Some(launched)) = (i.bid, i.launched) {
                let end = i.ended.unwrap_or(to);
                let y = y_price(bid.get());
                let _ = writeln!(
                    svg,
                    r#"<line x1="{:.1}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="{colour}" stroke-width="2" stroke-dasharray="6,3"/>"#,
                    x(launched),
                    x(end)
                );
                if i.ended_by_provider {
                    let _ = writeln!(
                        svg,
                        r#"<circle cx="{:.1}" cy="{y:.1}" r="3.5" fill="{colour}"/>"#,
                        x(end)
                    );
                }
            }
        }
        legend(&mut svg, PRICE_TOP, k, colour, &m.to_string());
    }
    let _ = writeln!(
        svg,
        r##"<text x="{}" y="{}" fill="#444">● eviction</text>"##,
        WIDTH - RIGHT + 12.0,
        PRICE_TOP + 18.0 + 16.0 * markets.len() as f64
    );
    off_scale.sort();
    off_scale.dedup();
    for (k, note) in off_scale.iter().enumerate() {
        let _ = writeln!(
            svg,
            r##"<text x="{}" y="{}" fill="#666" font-size="10">{}</text>"##,
            WIDTH - RIGHT + 12.0,
            PRICE_TOP + 40.0 + 16.0 * (markets.len() + k) as f64,
            escape(note)
        );
    }

    // Instances per tier over time, as steps.
    let mut changes: BTreeMap<Timestamp, [i32; 2]> = BTreeMap::new();
    for i in instances {
        let Some(launched) = i.launched else { continue };
        let k = if i.tier == Tier::Reliable { 0 } else { 1 };
        changes.entry(launched.max(from)).or_default()[k] += 1;
        if let Some(end) = i.ended {
            changes.entry(end.max(from)).or_default()[k] -= 1;
        }
    }
    let mut level = [0i32; 2];
    let mut steps: Vec<(Timestamp, [i32; 2])> = vec![(from, level)];
    for (t, d) in &changes {
        level[0] += d[0];
        level[1] += d[1];
        steps.push((*t, level));
    }
    let max_count = steps
        .iter()
        .map(|(_, l)| l[0].max(l[1]))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let y_count = |c: f64| COUNT_TOP + COUNT_HEIGHT * (1.0 - c / (max_count * 1.1));
    let _ = writeln!(
        svg,
        r##"<text x="{LEFT}" y="{}" fill="#444">instances per tier</text>"##,
        COUNT_TOP - 8.0
    );
    axes(&mut svg, COUNT_TOP, COUNT_HEIGHT, max_count * 1.1, |v| {
        format!("{v:.0}")
    });
    for (k, (name, colour)) in [
        ("on-demand (reliable)", "#333333"),
        ("spot (transient)", "#1f77b4"),
    ]
    .iter()
    .enumerate()
    {
        let mut path = String::new();
        let mut prev: Option<f64> = None;
        for (t, l) in &steps {
            let yv = y_count(f64::from(l[k]));
            match prev {
                None => {
                    let _ = write!(path, "M{:.1},{yv:.1}", x(*t));
                }
                Some(py) => {
                    let _ = write!(path, " L{:.1},{py:.1} L{:.1},{yv:.1}", x(*t), x(*t));
                }
            }
            prev = Some(yv);
        }
        if let Some(py) = prev {
            let _ = write!(path, " L{:.1},{py:.1}", x(to));
        }
        let _ = writeln!(
            svg,
            r#"<path d="{path}" fill="none" stroke="{colour}" stroke-width="2"/>"#
        );
        legend(&mut svg, COUNT_TOP, k, colour, name);
    }
    // Time axis labels (market time).
    for k in 0..=4 {
        let t = from.plus_secs(to.secs_since(from) * f64::from(k) / 4.0);
        let label = t.to_datetime().format("%m-%d %H:%M").to_string();
        let _ = writeln!(
            svg,
            r##"<text x="{:.1}" y="{}" text-anchor="middle" fill="#444">{label}</text>"##,
            x(t),
            COUNT_TOP + COUNT_HEIGHT + 18.0
        );
    }
    let _ = writeln!(
        svg,
        r##"<text x="{:.1}" y="{}" text-anchor="middle" fill="#444">market time (UTC)</text>"##,
        LEFT + (WIDTH - LEFT - RIGHT) / 2.0,
        COUNT_TOP + COUNT_HEIGHT + 36.0
    );
    svg.push_str("</svg>\n");
    svg
}

/// The `k`th entry of the legend right of the panel that starts at `top`: a swatch and a label.
fn legend(svg: &mut String, top: f64, k: usize, colour: &str, label: &str) {
    let ly = top + 14.0 + 16.0 * k as f64;
    let lx = WIDTH - RIGHT + 12.0;
    let _ = writeln!(
        svg,
        r#"<line x1="{lx}" x2="{}" y1="{}" y2="{}" stroke="{colour}" stroke-width="2"/><text x="{}" y="{ly}">{}</text>"#,
        lx + 18.0,
        ly - 4.0,
        ly - 4.0,
        lx + 24.0,
        escape(label)
    );
}

fn axes(svg: &mut String, top: f64, height: f64, max: f64, label: impl Fn(f64) -> String) {
    let _ = writeln!(
        svg,
        r##"<rect x="{LEFT}" y="{top}" width="{}" height="{height}" fill="none" stroke="#999"/>"##,
        WIDTH - LEFT - RIGHT
    );
    for k in 0..=4 {
        let v = max * f64::from(k) / 4.0;
        let y = top + height * (1.0 - f64::from(k) / 4.0);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end" fill="#444">{}</text>"##,
            WIDTH - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            label(v)
        );
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::market::UsdPerHour;
    use crate::prices::{OnDemandCatalog, PriceSeries};
    use crate::store::InstanceState;

    #[test]
    fn chart_is_well_formed_svg_with_every_market() {
        let m = Market::parse("us-east-1a/c3.xlarge").unwrap();
        let p = |v| UsdPerHour::new(v).unwrap();
        let series = PriceSeries::new(
            m.clone(),
            vec![(Timestamp(0), p(0.05)), (Timestamp(1_800_000), p(0.3))],
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
            requested: Timestamp(0),
            launched: Some(Timestamp(0)),
            ready: None,
            warned: None,
            ended: Some(Timestamp(1_920_000)),
            end_reason: Some("evicted".into()),
            ended_by_provider: true,
            launch_error: None,
            metadata_addr: None,
        };
        let svg = job_chart(
            "t <1>",
            &history,
            &[inst],
            Timestamp(0),
            Timestamp(3_600_000),
        );
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("us-east-1a/c3.xlarge"));
        assert!(svg.contains("t &lt;1&gt;"));
        assert!(svg.contains("<circle"), "the eviction is marked");
        assert_eq!(svg.matches("<svg").count(), 1);
    }
}

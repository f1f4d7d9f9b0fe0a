//! Loaders for the data sets in `data/ml`: CSV, gzip or plain, with errors naming file and line.

use crate::error::{AgentError, Result};
use flate2::read::GzDecoder;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

/// Images as bytes (row-major, `n × dim`) with labels; kept as `u8` so a process holds MNIST in
/// 47 MB instead of 188 MB, converting each minibatch to f32 on the fly.
#[derive(Debug, Clone, Default)]
pub struct ImageSet {
    pub dim: usize,
    pub pixels: Vec<u8>,
    pub labels: Vec<u8>,
    /// Pixel values are divided by this (255 for MNIST, 16 for digits).
    pub scale: f32,
}

impl ImageSet {
    pub fn len(&self) -> usize {
        self.labels.len()
    }
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
    pub fn row(&self, i: usize) -> &[u8] {
        &self.pixels[i * self.dim..(i + 1) * self.dim]
    }
    /// The rows `from..to` as a new set.
    pub fn slice(&self, from: usize, to: usize) -> ImageSet {
        ImageSet {
            dim: self.dim,
            pixels: self.pixels[from * self.dim..to * self.dim].to_vec(),
            labels: self.labels[from..to].to_vec(),
            scale: self.scale,
        }
    }
}

/// One rating, with users and items renumbered densely.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rating {
    pub user: u32,
    pub item: u32,
    pub value: f32,
    pub time: i64,
}

/// A ratings file after renumbering.
#[derive(Debug, Clone, Default)]
pub struct RatingSet {
    pub ratings: Vec<Rating>,
    pub num_users: usize,
    pub num_items: usize,
}

fn open(path: &Path) -> Result<Box<dyn BufRead>> {
    let file = File::open(path).map_err(|source| AgentError::Io {
        file: path.into(),
        source,
    })?;
    let reader: Box<dyn Read> = if path.extension().is_some_and(|e| e == "gz") {
        Box::new(GzDecoder::new(file))
    } else {
        Box::new(file)
    };
    Ok(Box::new(BufReader::with_capacity(1 << 20, reader)))
}

/// Calls `f(line_number, line)` for every non-empty line, turning I/O errors (including corrupt
/// gzip) into errors that name the file and line.
fn for_each_line(path: &Path, mut f: impl FnMut(u64, &str) -> Result<()>) -> Result<()> {
    let mut reader = open(path)?;
    let mut line = String::new();
    let mut n = 0u64;
    loop {
        line.clear();
        n += 1;
        let read = reader.read_line(&mut line).map_err(|e| AgentError::Parse {
            file: path.into(),
            line: n,
            message: format!("cannot read: {e}"),
        })?;
        if read == 0 {
            return Ok(());
        }
        let trimmed = line.trim_end_matches(['\n', '\r']);
        if !trimmed.is_empty() {
            f(n, trimmed)?;
        }
    }
}

fn parse_err(path: &Path, line: u64, message: impl Into<String>) -> AgentError {
    AgentError::Parse {
        file: path.into(),
        line,
        message: message.into(),
    }
}

/// Append a `label,f0..f{dim-1}` CSV (with a header line) to `set`.
pub fn load_images_into(path: &Path, dim: usize, set: &mut ImageSet) -> Result<()> {
    set.dim = dim;
    for_each_line(path, |n, line| {
        if n == 1 && line.starts_with("label") {
            return Ok(());
        }
        let mut fields = line.split(',');
        let label = fields.next().unwrap_or_default();
        let label: u8 = label
            .trim()
            .parse()
            .map_err(|_| parse_err(path, n, format!("label `{label}` is not a class number")))?;
        let start = set.pixels.len();
        for field in fields {
            let v: u8 = field
                .trim()
                .parse()
                .map_err(|_| parse_err(path, n, format!("pixel `{field}` is not in 0..=255")))?;
            set.pixels.push(v);
        }
        let got = set.pixels.len() - start;
        if got != dim {
            set.pixels.truncate(start);
            return Err(parse_err(
                path,
                n,
                format!("expected {dim} pixels, found {got}"),
            ));
        }
        set.labels.push(label);
        Ok(())
    })
}

/// MNIST: (train, test) from the two train halves and the test file in `dir`.
pub fn load_mnist(dir: &Path) -> Result<(ImageSet, ImageSet)> {
    let mut train = ImageSet {
        scale: 255.0,
        ..Default::default()
    };
    for f in ["mnist-train-1of2.csv.gz", "mnist-train-2of2.csv.gz"] {
        load_images_into(&dir.join(f), 784, &mut train)?;
    }
    let mut test = ImageSet {
        scale: 255.0,
        ..Default::default()
    };
    load_images_into(&dir.join("mnist-test.csv.gz"), 784, &mut test)?;
    Ok((train, test))
}

/// Digits 8×8: the first 80% by file order train, the rest test.
pub fn load_digits(dir: &Path) -> Result<(ImageSet, ImageSet)> {
    let mut all = ImageSet {
        scale: 16.0,
        ..Default::default()
    };
    load_images_into(&dir.join("digits-8x8.csv.gz"), 64, &mut all)?;
    let cut = all.len() * 4 / 5;
    Ok((all.slice(0, cut), all.slice(cut, all.len())))
}

/// Ratings as `user,item,rating,timestamp` (comma or tab separated, optional header; MovieLens
/// `u.data` also parses). Ids are renumbered densely in increasing id order, so every agent
/// computes the same numbering.
pub fn load_ratings(path: &Path) -> Result<RatingSet> {
    let mut raw: Vec<(u64, u64, f32, i64)> = Vec::new();
    for_each_line(path, |n, line| {
        let fields: Vec<&str> = line
            .split([',', '\t', ':'])
            .filter(|f| !f.is_empty())
            .map(str::trim)
            .collect();
        if n == 1 && fields.first().is_some_and(|f| f.parse::<u64>().is_err()) {
            return Ok(()); // header
        }
        if fields.len() < 4 {
            return Err(parse_err(
                path,
                n,
                format!("expected user,item,rating,timestamp; got `{line}`"),
            ));
        }
        let num = |i: usize, what: &str| -> Result<u64> {
            fields[i]
                .parse()
                .map_err(|_| parse_err(path, n, format!("{what} `{}` is not a number", fields[i])))
        };
        let user = num(0, "user")?;
        let item = num(1, "item")?;
        let rating: f32 = fields[2]
            .parse()
            .ok()
            .filter(|r: &f32| r.is_finite())
            .ok_or_else(|| parse_err(path, n, format!("rating `{}` is not a number", fields[2])))?;
        let time: i64 = fields[3].parse().map_err(|_| {
            parse_err(
                path,
                n,
                format!("timestamp `{}` is not an integer", fields[3]),
            )
        })?;
        raw.push((user, item, rating, time));
        Ok(())
    })?;
    if raw.is_empty() {
        return Err(AgentError::Data(format!("{}: no ratings", path.display())));
    }
    let dense = |key: fn(&(u64, u64, f32, i64)) -> u64| {
        let mut ids: Vec<u64> = raw.iter().map(key).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    };
    let users = dense(|r| r.0);
    let items = dense(|r| r.1);
    let index = |ids: &[u64], id: u64| ids.binary_search(&id).unwrap_or_default() as u32;
    let ratings = raw
        .iter()
        .map(|&(u, i, value, time)| Rating {
            user: index(&users, u),
            item: index(&items, i),
            value,
            time,
        })
        .collect();
    Ok(RatingSet {
        ratings,
        num_users: users.len(),
        num_items: items.len(),
    })
}

/// Split off, for every user, the latest `fraction` of their ratings by time (rounded to the
/// nearest count, always leaving at least one rating for training). Returns (train, held-out).
pub fn split_by_user_time(set: &RatingSet, fraction: f32) -> (Vec<Rating>, Vec<Rating>) {
    let mut by_user: Vec<Vec<Rating>> = vec![Vec::new(); set.num_users];
    for r in &set.ratings {
        by_user[r.user as usize].push(*r);
    }
    let (mut train, mut test) = (Vec::new(), Vec::new());
    for mut rs in by_user {
        rs.sort_by_key(|r| (r.time, r.item));
        let n = rs.len();
        let held = ((n as f32 * fraction).round() as usize).min(n.saturating_sub(1));
        let cut = n - held;
        train.extend_from_slice(&rs[..cut]);
        test.extend_from_slice(&rs[cut..]);
    }
    (train, test)
}

/// The data directory shipped with the repository, for tests and benchmarks.
pub fn repo_data_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../data/ml"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn parse_errors_name_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.csv");
        let mut f = File::create(&p).unwrap();
        writeln!(f, "label,f0,f1").unwrap();
        writeln!(f, "1,2,3").unwrap();
        writeln!(f, "1,2,x").unwrap();
        let mut set = ImageSet::default();
        let err = load_images_into(&p, 2, &mut set).unwrap_err().to_string();
        assert!(err.contains("bad.csv, line 3"), "{err}");
        assert!(err.contains("`x`"), "{err}");
    }

    #[test]
    fn rating_errors_name_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.csv");
        std::fs::write(&p, "user,item,rating,timestamp\n1,2,3,4\n1,2\n").unwrap();
        let err = load_ratings(&p).unwrap_err().to_string();
        assert!(err.contains("r.csv, line 3"), "{err}");
    }

    #[test]
    fn split_holds_out_latest_per_user() {
        let ratings = (0..20)
            .map(|t| Rating {
                user: (t % 2) as u32,
                item: t as u32,
                value: 1.0,
                time: 100 - t as i64,
            })
            .collect();
        let set = RatingSet {
            ratings,
            num_users: 2,
            num_items: 20,
        };
        let (train, test) = split_by_user_time(&set, 0.1);
        assert_eq!(test.len(), 2);
        assert_eq!(train.len(), 18);
        for t in &test {
            let latest = train
                .iter()
                .filter(|r| r.user == t.user)
                .map(|r| r.time)
                .max()
                .unwrap();
            assert!(t.time > latest);
        }
    }
}

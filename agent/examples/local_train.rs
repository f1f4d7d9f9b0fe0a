//! Train an app in one process with the distributed clock semantics; prints the metric per epoch.
use proteus_agent::apps::App;
use proteus_wire::agent_api::{AppConfig, StopCondition, TrainingConfig};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let app_cfg: AppConfig = serde_json::from_str(args.get(1).map_or(r#"{"type":"mlr"}"#, |s| s))?;
    let epochs: u32 = args.get(2).map_or(Ok(3), |s| s.parse())?;
    let cpe: u32 = args.get(3).map_or(Ok(60), |s| s.parse())?;
    let mut cfg = TrainingConfig::new(app_cfg);
    cfg.clocks_per_epoch = cpe;
    cfg.stop = StopCondition::Epochs { epochs };
    let t = std::time::Instant::now();
    let app = App::load(&cfg, &proteus_agent::data::repo_data_dir())?;
    println!("loaded in {:?}, model_len {}", t.elapsed(), app.model_len());
    for e in 1..=epochs {
        let t = std::time::Instant::now();
        let m = app.train_local(u64::from(e) * u64::from(cpe), cfg.num_partitions);
        println!("epochs {e}: {m:?} ({:?})", t.elapsed());
    }
    Ok(())
}

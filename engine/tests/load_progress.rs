//! Load progress on a synthetic checkpoint: every shard is reported once, after its last
//! tensor, and the counters end at the sum of the shard sizes on disk.
#![allow(clippy::unwrap_used, reason = "test code")]

use std::sync::{Arc, Mutex};

use engine::{
    config::{ExpertFormat, ModelConfig},
    synth::{GenerateOptions, Preset, generate},
    weights::{self, LoadProgress},
};

#[test]
fn shards_are_reported_once_and_totals_are_the_files() {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 4, ExpertFormat::Mxfp4, dir.path());
    generate(&options).unwrap();
    let mut files: Vec<(String, u64)> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::metadata(&p).unwrap().len())
        })
        .collect();
    files.sort();
    assert!(files.len() >= 2, "the tiny preset is sharded: {files:?}");
    let on_disk: u64 = files.iter().map(|f| f.1).sum();

    let seen: Arc<Mutex<Vec<(String, u64, proto::v1::LoadProgress)>>> = Arc::default();
    let hook_seen = Arc::clone(&seen);
    let progress = Arc::new(LoadProgress::new().with_shard_hook(Box::new(move |s| {
        hook_seen
            .lock()
            .unwrap()
            .push((s.name.clone(), s.bytes, s.overall));
    })));
    assert_eq!(progress.snapshot(), proto::v1::LoadProgress::default());
    let config = ModelConfig::from_dir(dir.path()).unwrap();
    let loaded = weights::load_with_progress(dir.path(), &config, &progress).unwrap();
    assert!(loaded.held_bytes() > 0);

    let end = progress.snapshot();
    assert!(end.done);
    assert_eq!(end.bytes_total, on_disk, "the total is the shards' sizes");
    assert_eq!(end.bytes_done, on_disk);
    assert_eq!(end.shards_done as usize, files.len());
    assert_eq!(end.shards_total as usize, files.len());
    assert_eq!(end.percent(), 100);
    assert_eq!(end.eta(), Some(std::time::Duration::ZERO));

    let seen = seen.lock().unwrap();
    let mut names: Vec<(String, u64)> = seen.iter().map(|s| (s.0.clone(), s.1)).collect();
    names.sort();
    assert_eq!(names, files, "each shard reported once, with its size");
    // Shards complete one after another: the counters only grow, and the last report is the
    // whole checkpoint.
    for pair in seen.windows(2) {
        assert!(pair[0].2.bytes_done < pair[1].2.bytes_done, "{pair:?}");
        assert_eq!(pair[0].2.shards_done + 1, pair[1].2.shards_done);
    }
    assert!(seen[0].2.bytes_done < on_disk);
    assert_eq!(seen.last().unwrap().2.bytes_done, on_disk);

    // The plain loader gives the same weights.
    let plain = weights::load(dir.path(), &config).unwrap();
    assert_eq!(plain.held_bytes(), loaded.held_bytes());
}

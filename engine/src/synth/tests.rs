use super::*;
use crate::model::{Logits, Model};

fn generate_to(dir: &Path, experts: ExpertFormat, seed: u64) {
    let options = GenerateOptions::new(Preset::Tiny, seed, experts, dir);
    generate(&options).unwrap();
}

fn digest(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect()
}

#[test]
fn same_seed_same_bytes_other_seed_other_bytes() {
    let (a, b, c) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    generate_to(a.path(), ExpertFormat::Mxfp4, 7);
    generate_to(b.path(), ExpertFormat::Mxfp4, 7);
    generate_to(c.path(), ExpertFormat::Mxfp4, 8);
    assert!(digest(a.path()) == digest(b.path()));
    assert!(digest(a.path()) != digest(c.path()));
}

#[test]
fn presets_exercise_every_kind() {
    use crate::config::{Attention, Routing};
    for preset in [Preset::Tiny, Preset::Small] {
        let c = preset.config(ExpertFormat::Nvfp4);
        let kinds: Vec<Attention> = c.layers.iter().map(|l| l.attention).collect();
        assert!(kinds.contains(&Attention::Sliding));
        assert!(kinds.iter().any(|k| matches!(k, Attention::Csa { .. })));
        assert!(kinds.iter().any(|k| matches!(k, Attention::Hca { .. })));
        assert!(c.layers.iter().any(|l| l.routing == Routing::Hash));
        assert!(c.layers.iter().any(|l| l.routing == Routing::TopK));
        assert!(c.hc_mult > 1 && c.o_groups > 1);
        // A 300-token prompt has more compressed rows than the indexer keeps.
        assert!(300 / 4 > c.index_topk);
        assert!(c.sliding_window < 300);
    }
}

#[test]
fn every_format_loads_and_runs() {
    for experts in [ExpertFormat::Bf16, ExpertFormat::Mxfp4, ExpertFormat::Nvfp4] {
        let dir = tempfile::tempdir().unwrap();
        generate_to(dir.path(), experts, 1);
        let model = Model::load(dir.path()).unwrap();
        assert_eq!(model.config.expert_format, experts);
        let mut state = model.new_state();
        let logits = model
            .forward(&mut state, &[5, 100, 7, 129_000], Logits::Last)
            .unwrap();
        assert_eq!(logits.len(), 1);
        assert_eq!(logits[0].len(), 129_280);
        assert!(logits[0].iter().all(|v| v.is_finite()));
    }
}

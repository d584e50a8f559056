//! The streaming detokenizer with stop strings, over any text cut into any chunks: the pieces
//! it releases are the text up to the earliest stop match (all of it without one), and never
//! half a character.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use router::api::detokenize::Detokenizer;
use tokenizers::{Tokenizer, models::bpe::BPE, pre_tokenizers::byte_level::ByteLevel};

/// One token per byte, so multi-byte characters always span tokens.
fn byte_tokenizer() -> Arc<Tokenizer> {
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort_unstable();
    let vocab: tokenizers::models::bpe::Vocab = alphabet
        .iter()
        .zip(0_u32..)
        .map(|(c, i)| (c.to_string(), i))
        .collect();
    let Ok(bpe) = BPE::builder().vocab_and_merges(vocab, Vec::new()).build() else {
        panic!("byte BPE");
    };
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, false, false)));
    tokenizer.with_decoder(Some(ByteLevel::new(false, false, false)));
    Arc::new(tokenizer)
}

fuzz_target!(|input: (&str, Vec<&str>, Vec<u8>)| {
    let (text, stop, cuts) = input;
    let stop: Vec<String> = stop
        .into_iter()
        .filter(|s| !s.is_empty())
        .take(4)
        .map(str::to_owned)
        .collect();
    let tokenizer = byte_tokenizer();
    let Ok(encoding) = tokenizer.encode(text, false) else {
        return;
    };
    let ids = encoding.get_ids();
    let mut detok = Detokenizer::new(Arc::clone(&tokenizer), stop.clone());
    let (mut out, mut stopped, mut at) = (String::new(), false, 0);
    let mut cuts = cuts
        .into_iter()
        .map(|c| usize::from(c % 8) + 1)
        .chain(std::iter::repeat(1));
    while at < ids.len() && !stopped {
        let end = (at + cuts.next().unwrap_or(1)).min(ids.len());
        let Ok(r) = detok.push(&ids[at..end], end == ids.len()) else {
            return;
        };
        assert!(text.contains('\u{FFFD}') || !r.text.contains('\u{FFFD}'));
        out.push_str(&r.text);
        stopped = r.stopped;
        at = end;
    }
    match stop.iter().filter_map(|s| text.find(s.as_str())).min() {
        Some(i) => assert!(stopped && out == text[..i]),
        None => assert!(!stopped && out == text),
    }
});

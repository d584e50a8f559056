//! Incremental detokenization that never emits half a character, stop strings held back
//! until resolved, and the backend's events as completion pieces (text, then exactly one
//! finish or failure): what `/v1/completions` streams and collects alike.

use std::{collections::VecDeque, sync::Arc};

use engine::sampling::FinishReason;
use futures::{Stream, StreamExt};
use tokenizers::Tokenizer;

use crate::{
    api::error::ApiError,
    backend::{BackendEvent, GeneratedToken, TokenStream},
    metrics::Tracker,
};

/// Incremental detokenization with stop strings. Decodes a short window of the growing id
/// list (the previous read position onwards, as vLLM does, so the work per token stays
/// constant and tokenizers that treat a leading token specially still decode alike) and takes
/// only the new complete text: never text ending in U+FFFD (half a character) nor a tail that
/// may begin a stop string.
#[derive(Debug)]
pub struct Detokenizer {
    tokenizer: Arc<Tokenizer>,
    stop: Vec<String>,
    ids: Vec<u32>,
    /// The decoding window starts here; `read` is where the decoded text ends.
    prefix: usize,
    read: usize,
    /// Complete text of `ids[..read]`.
    text: String,
    /// Bytes of `text` already released.
    sent: usize,
    /// Special tokens are left out of the text (vLLM's `skip_special_tokens`).
    skip_special: bool,
}

/// The tokenizer failed to decode the generated ids (its message as it gave it).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DetokenizeError(#[source] tokenizers::Error);

/// What [`Detokenizer::push`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    pub text: String,
    /// A stop string matched: the text ends before it and generation is over.
    pub stopped: bool,
}

impl Detokenizer {
    pub fn new(tokenizer: Arc<Tokenizer>, stop: Vec<String>) -> Self {
        Self {
            tokenizer,
            stop,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            text: String::new(),
            sent: 0,
            skip_special: true,
        }
    }

    /// Keeps special tokens in the text (`skip_special_tokens: false`).
    #[must_use]
    pub fn keeping_special_tokens(mut self, keep: bool) -> Self {
        self.skip_special = !keep;
        self
    }

    /// The text of `ids`; special tokens (eos under `ignore_eos`, markers) left out unless
    /// kept, as vLLM's `skip_special_tokens` says.
    fn decode(&self, ids: &[u32]) -> Result<String, DetokenizeError> {
        if ids.is_empty() {
            return Ok(String::new());
        }
        self.tokenizer
            .decode(ids, self.skip_special)
            .map_err(DetokenizeError)
    }

    /// Extends `text` with the newly complete text (all of it with `last`).
    fn advance(&mut self, last: bool) -> Result<(), DetokenizeError> {
        if self.read == self.ids.len() {
            return Ok(());
        }
        let before = self.decode(&self.ids[self.prefix..self.read])?;
        let window = self.decode(&self.ids[self.prefix..])?;
        let complete = !window.ends_with('\u{FFFD}');
        if (complete || last)
            && window.len() >= before.len()
            && window.is_char_boundary(before.len())
        {
            self.text.push_str(&window[before.len()..]);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        Ok(())
    }

    /// Adds tokens; returns the text that is now final. With `last`, everything left is
    /// released (a trailing U+FFFD included: the tokens really end mid-character).
    pub fn push(&mut self, ids: &[u32], last: bool) -> Result<Released, DetokenizeError> {
        self.ids.extend_from_slice(ids);
        self.advance(last)?;
        let full = &self.text;
        // A match may start in released text only if it ends in new text; released text never
        // ended with the start of a stop string, so searching from `sent` minus the longest
        // stop string is enough.
        let search_from = floor_boundary(
            full,
            self.sent
                .saturating_sub(self.stop.iter().map(String::len).max().unwrap_or(0)),
        );
        let hit = self
            .stop
            .iter()
            .filter_map(|s| {
                full[search_from..]
                    .find(s.as_str())
                    .map(|p| search_from + p)
            })
            .min();
        if let Some(at) = hit {
            let text = full.get(self.sent..at).unwrap_or_default().to_owned();
            self.sent = at.max(self.sent);
            return Ok(Released {
                text,
                stopped: true,
            });
        }
        let mut safe = full.len();
        if !last {
            // A tail that may begin a stop string: wait until resolved.
            safe -= self
                .stop
                .iter()
                .map(|s| partial_suffix(full, s))
                .max()
                .unwrap_or(0);
        }
        if safe <= self.sent || !full.is_char_boundary(self.sent) {
            return Ok(Released {
                text: String::new(),
                stopped: false,
            });
        }
        let text = full[self.sent..safe].to_owned();
        self.sent = safe;
        Ok(Released {
            text,
            stopped: false,
        })
    }
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Length of the longest proper prefix of `stop` that `text` ends with.
fn partial_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .filter(|&n| stop.is_char_boundary(n))
        .find(|&n| text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

/// One step of a completion.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// The log-probabilities of the prompt's tokens after the first (`echo` with `logprobs`),
    /// before any other piece.
    Prompt(Vec<GeneratedToken>),
    Text(String),
    /// The tokens (with their log-probabilities) of the text that follows (or, before the
    /// finish, of tokens whose text is empty); only when `logprobs` was asked for.
    Tokens(Vec<GeneratedToken>),
    Finish {
        reason: &'static str,
        completion_tokens: usize,
    },
    Failed(ApiError),
}

struct Run {
    tokens: Option<TokenStream>,
    tracker: Option<Tracker>,
    detok: Detokenizer,
    held: Option<GeneratedToken>,
    generated: usize,
    out: VecDeque<Piece>,
    /// `logprobs` asked for: tokens go through the detokenizer one by one, each listed with
    /// the text it completes.
    logprobs: bool,
    /// Tokens released into the detokenizer whose text has not come out yet.
    pending: Vec<GeneratedToken>,
    /// Eos and stop ids: a `Stop` request's last token is dropped only when it is one (a
    /// completed grammar ends on a token of the output).
    stop_ids: Vec<u32>,
}

impl Run {
    fn release_ids(&mut self, ids: &[u32], last: bool) -> Result<bool, DetokenizeError> {
        let released = self.detok.push(ids, last)?;
        if !released.text.is_empty() {
            if !self.pending.is_empty() {
                self.out
                    .push_back(Piece::Tokens(std::mem::take(&mut self.pending)));
            }
            self.out.push_back(Piece::Text(released.text));
        }
        Ok(released.stopped)
    }

    /// Releases `tokens` (one by one when their log-probabilities are listed, so each is
    /// listed with its own text and none past a stop string); whether a stop string ended it.
    fn release(
        &mut self,
        tokens: Vec<GeneratedToken>,
        last: bool,
    ) -> Result<bool, DetokenizeError> {
        if !self.logprobs {
            let ids: Vec<u32> = tokens.iter().map(|t| t.id).collect();
            return self.release_ids(&ids, last);
        }
        let n = tokens.len();
        for (i, token) in tokens.into_iter().enumerate() {
            let id = token.id;
            self.pending.push(token);
            if self.release_ids(&[id], last && i + 1 == n)? {
                return Ok(true);
            }
        }
        if last && n == 0 {
            return self.release_ids(&[], true);
        }
        Ok(false)
    }

    fn finish(&mut self, reason: &'static str) {
        if !self.pending.is_empty() {
            self.out
                .push_back(Piece::Tokens(std::mem::take(&mut self.pending)));
        }
        if let Some(tracker) = self.tracker.as_mut() {
            tracker.succeeded();
        }
        self.out.push_back(Piece::Finish {
            reason,
            completion_tokens: self.generated,
        });
        self.end();
    }

    fn fail(&mut self, error: ApiError) {
        tracing::error!(%error, "completion failed");
        if let Some(tracker) = self.tracker.as_mut() {
            tracker.server_error();
        }
        self.out.push_back(Piece::Failed(error));
        self.end();
    }

    /// Drops the backend stream (cancelling it if still running) and the tracker.
    fn end(&mut self) {
        self.tokens = None;
        self.tracker = None;
    }
}

/// Backend events as completion pieces: text, then exactly one `Finish` or `Failed`.
pub fn pieces(
    tokens: TokenStream,
    tracker: Option<Tracker>,
    detok: Detokenizer,
    stop_ids: Vec<u32>,
    logprobs: bool,
) -> impl Stream<Item = Piece> + Send + 'static {
    let run = Run {
        stop_ids,
        logprobs,
        pending: Vec::new(),
        tokens: Some(tokens),
        tracker,
        detok,
        held: None,
        generated: 0,
        out: VecDeque::new(),
    };
    futures::stream::unfold(run, |mut run| async move {
        loop {
            if let Some(piece) = run.out.pop_front() {
                return Some((piece, run));
            }
            let tokens = run.tokens.as_mut()?;
            let event = tokens.next().await;
            if let Some(BackendEvent::Tokens(batch)) = &event {
                match run.tracker.as_mut() {
                    Some(tracker) => tracker.generated(batch.len()),
                    None => crate::metrics::count_generated(batch.len()),
                }
            }
            match event {
                Some(BackendEvent::Tokens(batch)) => {
                    run.generated += batch.len();
                    // The last token is held back: it is the eos that ends a `Stop` request.
                    let mut toks: Vec<GeneratedToken> = run.held.take().into_iter().collect();
                    toks.extend(batch);
                    run.held = toks.pop();
                    match run.release(toks, false) {
                        Ok(true) => run.finish("stop"),
                        Ok(false) => {}
                        Err(e) => run.fail(ApiError::Internal(e.to_string())),
                    }
                }
                Some(BackendEvent::Finished { reason, .. }) => {
                    let (toks, reason): (Vec<GeneratedToken>, _) = match reason {
                        FinishReason::Length => (run.held.take().into_iter().collect(), "length"),
                        FinishReason::Stop => (
                            run.held
                                .take()
                                .filter(|t| !run.stop_ids.contains(&t.id))
                                .into_iter()
                                .collect(),
                            "stop",
                        ),
                    };
                    match run.release(toks, true) {
                        Ok(_) => run.finish(reason),
                        Err(e) => run.fail(ApiError::Internal(e.to_string())),
                    }
                }
                Some(BackendEvent::PromptLogprobs(entries)) => {
                    run.out.push_back(Piece::Prompt(entries));
                }
                Some(BackendEvent::Failed(error)) => run.fail(ApiError::from(error)),
                None => run.fail(ApiError::Internal(
                    "the backend stream ended before the request finished".into(),
                )),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use tokenizers::{models::bpe::BPE, pre_tokenizers::byte_level::ByteLevel};

    use super::*;
    use crate::backend::BackendError;

    /// A byte-level tokenizer with one token per byte: multi-byte characters always span
    /// several tokens.
    fn byte_tokenizer() -> Arc<Tokenizer> {
        let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        alphabet.sort_unstable();
        let vocab: tokenizers::models::bpe::Vocab = alphabet
            .iter()
            .zip(0_u32..)
            .map(|(c, i)| (c.to_string(), i))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, Vec::new())
            .build()
            .unwrap();
        let mut tokenizer = Tokenizer::new(bpe);
        tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, false, false)));
        tokenizer.with_decoder(Some(ByteLevel::new(false, false, false)));
        Arc::new(tokenizer)
    }

    fn ids(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
        tokenizer.encode(text, false).unwrap().get_ids().to_vec()
    }

    /// Feeds `text` one token at a time; returns the released pieces and whether it stopped.
    fn feed(text: &str, stop: &[&str]) -> (Vec<String>, bool) {
        let tokenizer = byte_tokenizer();
        let ids = ids(&tokenizer, text);
        assert_eq!(ids.len(), text.len(), "one token per byte");
        let mut detok = Detokenizer::new(tokenizer, stop.iter().map(|s| (*s).to_owned()).collect());
        let mut out = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let r = detok.push(&[*id], i + 1 == ids.len()).unwrap();
            if !r.text.is_empty() {
                out.push(r.text);
            }
            if r.stopped {
                return (out, true);
            }
        }
        (out, false)
    }

    #[test]
    fn never_emits_half_a_character() {
        let text = "héllo ünïcødé 你好 🦀!";
        let (pieces, stopped) = feed(text, &[]);
        assert!(!stopped);
        for p in &pieces {
            assert!(!p.contains('\u{FFFD}'), "{pieces:?}");
        }
        assert_eq!(pieces.concat(), text);
        assert!(pieces.len() > 10, "released incrementally: {pieces:?}");
    }

    #[test]
    fn stop_strings_spanning_tokens_are_held_back() {
        let (pieces, stopped) = feed("hello STOP world", &["STOP"]);
        assert!(stopped);
        assert_eq!(pieces.concat(), "hello ");
        assert!(pieces.iter().all(|p| !p.contains('S')), "{pieces:?}");
        // A partial match that does not complete is released.
        let (pieces, stopped) = feed("a STx STOq", &["STOP"]);
        assert!(!stopped);
        assert_eq!(pieces.concat(), "a STx STOq");
        // Multi-byte stop string; the earliest of several wins.
        let (pieces, stopped) = feed("x 你好 y end", &["end", "好"]);
        assert!(stopped);
        assert_eq!(pieces.concat(), "x 你");
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config { cases: 96, ..Default::default() })]

        /// Any text, cut into any chunks, with any stop strings: the released pieces are the
        /// text up to the earliest stop match (all of it without one), never half a character.
        #[test]
        fn released_text_equals_one_shot_decoding(
            text in "[a-zé你🦀 ]{0,40}",
            cuts in proptest::collection::vec(1usize..6, 0..40),
            stop in proptest::collection::vec("[a-zé你 ]{1,3}", 0..3),
        ) {
            let tokenizer = byte_tokenizer();
            let all = ids(&tokenizer, &text);
            let mut detok = Detokenizer::new(Arc::clone(&tokenizer), stop.clone());
            let (mut out, mut stopped, mut at) = (String::new(), false, 0);
            let mut cuts = cuts.into_iter().cycle().chain(std::iter::repeat(1));
            while at < all.len() && !stopped {
                let end = (at + cuts.next().unwrap_or(1)).min(all.len());
                let r = detok.push(&all[at..end], end == all.len()).unwrap();
                proptest::prop_assert!(!r.text.contains('\u{FFFD}'), "{:?}", r.text);
                out.push_str(&r.text);
                stopped = r.stopped;
                at = end;
            }
            let first_stop = stop.iter().filter_map(|s| text.find(s.as_str())).min();
            if let Some(i) = first_stop {
                proptest::prop_assert!(stopped);
                proptest::prop_assert_eq!(out, &text[..i]);
            } else {
                proptest::prop_assert!(!stopped);
                proptest::prop_assert_eq!(out, text);
            }
        }
    }

    #[test]
    fn last_push_releases_a_dangling_partial_character() {
        let tokenizer = byte_tokenizer();
        let all = ids(&tokenizer, "é");
        let mut detok = Detokenizer::new(Arc::clone(&tokenizer), Vec::new());
        assert_eq!(detok.push(&all[..1], false).unwrap().text, "");
        assert_eq!(detok.push(&[], true).unwrap().text, "\u{FFFD}");
    }

    async fn drive(events: Vec<BackendEvent>, stop: &[&str]) -> Vec<Piece> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for e in events {
            tx.send(e).unwrap();
        }
        drop(tx);
        let detok = Detokenizer::new(
            byte_tokenizer(),
            stop.iter().map(|s| (*s).to_owned()).collect(),
        );
        let tracker = Tracker::new(crate::metrics::Endpoint::Completions);
        // `Z` stands for the eos id.
        let eos = ids(&byte_tokenizer(), "Z");
        pieces(
            TokenStream::new(rx, || {}),
            Some(tracker),
            detok,
            eos,
            false,
        )
        .collect()
        .await
    }

    fn tokens(text: &str) -> BackendEvent {
        let tokenizer = byte_tokenizer();
        BackendEvent::Tokens(
            ids(&tokenizer, text)
                .into_iter()
                .map(|id| crate::backend::GeneratedToken {
                    id,
                    logprob: None,
                    top_logprobs: Vec::new(),
                })
                .collect(),
        )
    }

    #[tokio::test]
    async fn backend_failure_ends_with_failed_not_finish() {
        let pieces = drive(
            vec![
                tokens("abc"),
                BackendEvent::Failed(BackendError::unavailable("boom")),
            ],
            &[],
        )
        .await;
        assert_eq!(
            pieces.last(),
            Some(&Piece::Failed(ApiError::from(BackendError::unavailable(
                "boom"
            ))))
        );
        assert!(!pieces.iter().any(|p| matches!(p, Piece::Finish { .. })));
        let pieces = drive(vec![tokens("abc")], &[]).await;
        assert!(
            matches!(pieces.last(), Some(Piece::Failed(e)) if e.to_string().contains("ended before"))
        );
    }

    #[tokio::test]
    async fn eos_is_dropped_and_length_keeps_the_last_token() {
        let usage = engine::scheduler::Usage::default();
        let stop = BackendEvent::Finished {
            reason: FinishReason::Stop,
            usage,
        };
        let pieces = drive(vec![tokens("ab"), tokens("cZ"), stop], &[]).await;
        assert_eq!(pieces.first(), Some(&Piece::Text("a".into())));
        let text: String = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(text, "abc", "the eos (last token) is not text");
        assert_eq!(
            pieces.last(),
            Some(&Piece::Finish {
                reason: "stop",
                completion_tokens: 4
            })
        );
        // A `Stop` whose last token is no stop id (a completed grammar) keeps it.
        let stop = BackendEvent::Finished {
            reason: FinishReason::Stop,
            usage,
        };
        let pieces = drive(vec![tokens("abc"), stop], &[]).await;
        let kept: String = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(kept, "abc");
        let length = BackendEvent::Finished {
            reason: FinishReason::Length,
            usage,
        };
        let pieces = drive(vec![tokens("abc"), length], &[]).await;
        assert!(pieces.contains(&Piece::Text("c".into())), "{pieces:?}");
        // A stop string ends the request early with finish `stop`.
        let pieces = drive(vec![tokens("xxENDyy")], &["END"]).await;
        assert_eq!(
            pieces,
            vec![
                Piece::Text("xx".into()),
                Piece::Finish {
                    reason: "stop",
                    completion_tokens: 7
                }
            ]
        );
    }
}

//! Prompt chunks on a device that keeps the sequences' state ([`StepDevice::prompt_step`],
//! where its [`StepDevice::prompt_chunk`] is not 0). A request's first chunk seats it in a
//! slot (its cached prefix loaded from its pages), which it keeps to its last token; each step
//! sends the chunks' tokens and gets back the logits rows they ask for and what each added to
//! its state, which is stored in its pages as the host forward's state is: so the prefix cache
//! offers its blocks, a prefill-only request streams its pages to its decode worker, and the
//! pages hold the prompt as they do without a device. A chunk may complete several blocks; it
//! sends back the compressors' state at its end only, so the blocks inside it enter the prefix
//! cache as pages without a resumable slot (`PagedStore::offer_inner_pages`) and the one ending
//! at its end as a block a later request resumes from: a cached prefix resumes at the last
//! chunk end it matches.
//!
//! [`StepDevice::prompt_chunk`]: super::StepDevice::prompt_chunk
//! [`StepDevice::prompt_step`]: super::StepDevice::prompt_step

use std::ops::Range;

use super::{Engine, Event, StepError, device::PromptChunk, handoff};
use crate::model::Logits;

impl Engine {
    /// The prompt chunks of `plan` (running index, positions, logits wanted) in one prompt
    /// step on the device: their logits sampled here, their state stored in their pages.
    /// A request that cannot be seated fails alone; a failed step fails every request of it.
    /// Returns the number of state parts emitted.
    pub(super) fn device_prompt_step(
        &mut self,
        plan: &[(usize, Range<usize>, Logits)],
        emit: &mut (dyn FnMut(Event) + Send),
        events: &mut Vec<Event>,
        failed: &mut Vec<(usize, StepError)>,
    ) -> usize {
        let mut emitted = 0;
        let mut stepping = Vec::with_capacity(plan.len());
        for (i, range, logits) in plan {
            match self.seat(*i) {
                Ok(slot) => stepping.push((*i, range.clone(), *logits, slot)),
                Err(e) => failed.push((*i, e)),
            }
        }
        // A prefill-only request's cached pages go before its first chunk, as without a device.
        for (i, range, ..) in &stepping {
            let r = &self.running[*i];
            if r.handoff {
                match handoff::cached_part(&self.store, r, range.start) {
                    Ok(Some(part)) => {
                        emitted += 1;
                        emit(part);
                    }
                    Ok(None) => {}
                    Err(e) => failed.push((*i, e.into())),
                }
            }
        }
        stepping.retain(|(i, ..)| !failed.iter().any(|(f, _)| f == i));
        let Some(d) = self.device.as_mut() else {
            return emitted;
        };
        if stepping.is_empty() {
            return emitted;
        }
        let name = d.device.name().to_owned();
        let chunks: Vec<PromptChunk<'_>> = stepping
            .iter()
            .map(|(i, range, logits, slot)| PromptChunk {
                slot: *slot,
                start: range.start,
                tokens: &self.running[*i].tokens[range.clone()],
                logits: *logits,
            })
            .collect();
        let vocab = self.model.config.vocab_size;
        d.steps += 1;
        let outs = match d.device.prompt_step(&chunks) {
            Ok(outs)
                if outs.len() == chunks.len()
                    && outs.iter().zip(&chunks).all(|(o, c)| {
                        o.logits.len() == c.rows()
                            && o.logits.iter().all(|row| row.len() == vocab)
                            && (o.delta.from, o.delta.to) == (c.start, c.start + c.tokens.len())
                    }) =>
            {
                outs
            }
            Ok(outs) => {
                let e = StepError::Forward(format!(
                    "{name} prompt step: {} outputs for {} chunks, not each with the rows and \
                     positions its chunk asked for",
                    outs.len(),
                    chunks.len()
                ));
                failed.extend(stepping.iter().map(|(i, ..)| (*i, e.clone())));
                return emitted;
            }
            Err(e) => {
                let e = StepError::Forward(format!("{name} prompt step: {e}"));
                // The group's other ranks may wait for this one's exchanges: they stop now.
                self.model.fail_groups(&e.to_string());
                failed.extend(stepping.iter().map(|(i, ..)| (*i, e.clone())));
                return emitted;
            }
        };
        let mut ready = Vec::with_capacity(stepping.len());
        for ((i, range, ..), out) in stepping.into_iter().zip(outs) {
            // A device's result is checked where it enters: a non-finite logit fails its
            // request (the sampler would mask it and answer anyway).
            if let Some(at) = out
                .logits
                .iter()
                .find_map(|row| row.iter().position(|v| !v.is_finite()))
            {
                let e = format!("{name} prompt step: non-finite logit at {at}");
                failed.push((i, StepError::Forward(e)));
                continue;
            }
            let r = &mut self.running[i];
            let stored = self
                .store
                .scatter_delta(&mut r.seq, &out.delta)
                .and_then(|()| self.store.offer_inner_pages(&r.seq, &r.tokens, range.start))
                .and_then(|()| self.store.offer_block(&r.seq, &r.tokens))
                .and_then(|()| {
                    if r.handoff {
                        handoff::chunk_part(&self.store, r, &range)
                    } else {
                        Ok(None)
                    }
                });
            match stored {
                Ok(Some(part)) => {
                    emitted += 1;
                    emit(part);
                }
                Ok(None) => {}
                Err(e) => {
                    failed.push((i, e.into()));
                    continue;
                }
            }
            let mut rows = out.logits;
            match self.take_prompt_logprobs(i, &range, &mut rows) {
                Ok(next) => ready.push((i, next)),
                Err(e) => failed.push((i, e)),
            }
        }
        let rows: Vec<(usize, Option<&[f32]>)> = ready
            .iter()
            .map(|(i, next)| (*i, next.as_deref()))
            .collect();
        let sampled = self.sample_all(&rows);
        for ((i, _), sampled) in ready.iter().zip(sampled) {
            if let Err(e) = self.take_sampled(*i, sampled, events) {
                failed.push((*i, e));
            }
        }
        emitted
    }
}
